"""From a sweep to a decision: which draft, with which k, to ship.

    python -m analysis.report <results dir | entity/project[/sweep_id]>

The pipeline, one module per step:
  load     every cell of a local results tree or a W&B sweep into two frames
           (cells: one row per cell; prompts: one row per cell x prompt)
  sizes    draft parameters and weight memory, for the speedup-vs-size front
  fit      per (target, draft, dataset, sampling): alpha with its interval,
           cost ratio c, verify cost v(n); predicted speedup for k = 1..16,
           and the same prediction under another machine's costs (what-if)
  decide   per category and for a weighted traffic mix: the best draft and
           k, paired per-prompt bootstrap intervals, the test between the
           best two drafts, and "ship no speculation" when nothing is
           confidently faster than the baseline
  figures  the seaborn figures (PNG)
  report   the command: writes report.md, figures/, cells.csv, fits.csv,
           decision.json into one folder (docs/report.md)
"""
