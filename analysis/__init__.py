"""From a sweep to a decision: which draft, with which k, to ship.

    python -m analysis.report <results dir | entity/project[/sweep_id]>

The pipeline, one module per step:
  load      every cell of a local results tree or a W&B sweep, refusing a
            summary of another schema, into analysis.frames' two frames
            (cells: one row per cell; prompts: one row per cell x prompt),
            named by analysis.names (prompt sets, drafts, setups)
  fit       per (target, draft, dataset, sampling): alpha with its interval,
            cost ratio c, verify cost v(n); predicted speedup for k = 1..16,
            and the same prediction under another machine's costs (what-if)
  decide    per category and for a weighted traffic mix: the best draft and
            k (analysis.paired: candidates aligned by prompt, the paired
            bootstrap; analysis.ship: the ship rule, the test between the
            best two drafts, the verdict, what would change it), and "ship no
            speculation" when nothing is confidently faster than the baseline
  figures   the seaborn figures (PNG)
  markdown  report.md
  report    the command: writes report.md, figures/, cells.csv, fits.csv,
            decision.json into one folder (docs/report.md)
"""
