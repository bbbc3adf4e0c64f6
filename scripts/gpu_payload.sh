#!/usr/bin/env bash
# Packs what scripts/gpu_check.sh needs on a GPU machine without network access, in one folder:
#   bash scripts/gpu_payload.sh               # where PyPI is reachable; writes .gpu/1 (ignored by git)
# then on the GPU machine, with the working tree and .gpu/1 copied over, one command:
#   bash scripts/gpu_check.sh --stash .gpu/1 --run
#
# Such a machine may have CUDA torch and transformers (5.17, say, which runs assisted
# generation only with a dynamic cache: we carry the transformers we test with)
# but not hydra-core, omegaconf, antlr4, gguf, datasets, dill or multiprocess,
# and receives at most 64 MiB of files per command, the working tree included
# (its tracked files and the untracked ones git does not ignore, about 52 MB). The
# wheels alone take about 21 MB (transformers 14, hf-xet 4), too much beside the tree;
# so their files are extracted (what pip install --target holds, .dist-info included:
# importlib.metadata sees the versions) and packed as one xz archive (preset 9),
# .gpu/1/site.tar.xz (about 8.4 MB, 3 of them hf-xet's library), with COMMIT, the
# commit the payload was packed at (the machine gets no .git).
# The script prints the total that one command carries and fails when it exceeds 64 MiB.
#
# --embedded also packs the embedded model's 98 MB GGUF file (the SmolLM2 parts of
# gpu_check.sh --embedded and --distill) with its SHA-256, cut into parts .gpu/2 ...
# .gpu/N that each fit beside the tree. Each command but the last stashes its folder
# on the machine; the last assembles, checks and runs:
#   command i < N:  with .gpu/i copied over: bash scripts/gpu_check.sh --stash .gpu/i
#   command N:      with .gpu/N copied over: bash scripts/gpu_check.sh --stash .gpu/N --run --embedded
# The stash lives in /tmp on the machine, so run the commands one after another on the same machine.
# PYTHON names the interpreter (default python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
LIMIT=$((64 * 1024 * 1024))
MARGIN=$((3 * 1000 * 1000))  # the tree may grow a little before the commands are run
embedded=0
case "${1:-}" in
    '') ;;
    --embedded) embedded=1 ;;
    *) echo "usage: bash scripts/gpu_payload.sh [--embedded]" >&2; exit 2 ;;
esac

# bytes: the total size of the files named on stdin (NUL-separated); a tracked file deleted here counts nothing.
bytes() { { du -cb --files0-from=- 2>/dev/null || true; } | tail -1 | cut -f1; }
tree=$(git ls-files -z | bytes)
untracked=$(git ls-files -z --others --exclude-standard | bytes)
tree=${tree:-0} untracked=${untracked:-0}

rm -rf .gpu && mkdir -p .gpu/stage/wheels .gpu/1
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"

# transformers as tested here, with the huggingface_hub it requires (transformers 5.25 refuses to import
# beside huggingface_hub 1.x) and that hub's own needs, each at the version installed here.
pinned='import importlib.metadata as m; print(" ".join(f"{n}=={m.version(n)}" for n in "transformers huggingface-hub httpx2 httpcore2 truststore hf-xet click".split()))'
# Wheels for the machine's Python 3.12. All are pure Python but hf-xet (abi3); antlr4 4.9.3 (what
# omegaconf 2.3 pins) is published only as a source archive, so it is built here.
$PY -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/stage/wheels $($PY -c "$pinned") hydra-core==1.3.8 omegaconf==2.3.1 gguf==0.19.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
$PY -m pip wheel --quiet --no-deps -w .gpu/stage/wheels antlr4-python3-runtime==4.9.3

# The wheels' files into one tar.xz, laid out as pip install --target lays them (a wheel's
# NAME.data/purelib and platlib at the top; its scripts, headers and data left out).
$PY -c '
import sys, tarfile, time, zipfile
out, wheels, seen = sys.argv[1], sorted(sys.argv[2:]), set()
with tarfile.open(out, "w:xz", preset=9) as site:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as files:
            for info in files.infolist():
                name = info.filename
                top, _, rest = name.partition("/")
                if top.endswith(".data"):
                    kind, _, name = rest.partition("/")
                    if kind not in ("purelib", "platlib"):
                        continue
                if info.is_dir() or not name or name in seen:
                    continue
                seen.add(name)
                entry = tarfile.TarInfo(name)
                entry.size, entry.mtime = info.file_size, int(time.mktime(info.date_time + (0, 0, -1)))
                entry.mode = (info.external_attr >> 16) & 0o777 or 0o644
                with files.open(info) as data:
                    site.addfile(entry, data)
print(f"site.tar.xz: {len(seen)} files from {len(wheels)} wheels")
' .gpu/1/site.tar.xz .gpu/stage/wheels/*.whl
git describe --always --dirty --abbrev=12 > .gpu/1/COMMIT  # the machine gets the tree without .git: the figures name their code

n=1
if [ "$embedded" = 1 ]; then  # the GGUF file in parts .gpu/2 ..., each filling what the tree leaves of a command
    part=${PART_BYTES:-$((LIMIT - tree - untracked - MARGIN))}  # PART_BYTES: a smaller part, if a command's files are refused as too large
    [ -n "${PART_BYTES:-}" ] || [ "$part" -gt $((8 * 1000 * 1000)) ] \
        || { echo "error: the working tree ($tree bytes tracked, $untracked untracked) leaves no room for a part of the GGUF file in 64 MiB" >&2; exit 1; }
    gguf=$($PY -c 'from harness.models.embedded import find_gguf; print(find_gguf())')
    name=$(basename "$gguf")
    (cd "$(dirname "$gguf")" && sha256sum "$name") > .gpu/1/SHA256SUMS  # with the first part: the last command checks that every part came
    split -b "$part" -d -a 2 "$gguf" ".gpu/stage/$name.part-"
    for chunk in .gpu/stage/"$name".part-*; do
        n=$((n + 1)); mkdir -p ".gpu/$n" && mv "$chunk" ".gpu/$n/"
    done
fi
rm -rf .gpu/stage

echo "payload: the working tree holds $tree bytes tracked and $untracked untracked; each command carries it and one folder (at most $LIMIT bytes in all):"
over=0
for i in $(seq 1 "$n"); do
    size=$(find ".gpu/$i" -type f -print0 | bytes)
    total=$((tree + untracked + size))
    if [ "$i" -lt "$n" ]; then run=""; elif [ "$embedded" = 1 ]; then run=" --run --embedded"; else run=" --run"; fi
    echo "  .gpu/$i: $size bytes, $total with the tree; then: bash scripts/gpu_check.sh --stash .gpu/$i$run"
    [ "$total" -le "$LIMIT" ] || over=$i
done
if [ "$over" != 0 ]; then
    echo "error: the working tree with .gpu/$over exceeds 64 MiB ($LIMIT bytes): remove untracked files, or set PART_BYTES smaller" >&2; exit 1
fi
[ "$n" = 1 ] || echo "  run them one after another on the same machine, the last with time to spare (it also stashes)."
echo "  With less time left than the check's default, add --seconds S to the last command (the check writes each part as it finishes)."
