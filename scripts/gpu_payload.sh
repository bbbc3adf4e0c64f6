#!/usr/bin/env bash
# Packs what scripts/gpu_check.sh needs on a GPU machine without network access:
#   bash scripts/gpu_payload.sh        # on a machine with PyPI access; writes .gpu/1, .gpu/2, ...
#
# Such a machine may have CUDA torch and transformers (5.17, say, which runs assisted
# generation only with a dynamic cache: we carry the transformers we test with)
# but not hydra-core, omegaconf, antlr4, gguf, datasets, dill or multiprocess,
# nor the embedded model, and receive at most 64 MiB of files per command,
# the repository included. So the pure Python wheels and the 98 MB GGUF file
# are cut into parts that each fit beside the tracked tree, one folder per
# command. Each command but the last stashes its folder on the machine; the
# last one assembles, installs and runs:
#   command i < n:  with .gpu/i copied over: bash scripts/gpu_check.sh --stash .gpu/i
#   command n:      with .gpu/n copied over: bash scripts/gpu_check.sh --stash .gpu/n --run
# The stash lives in /tmp on the machine, so run the commands one after another on the same machine.
# PYTHON names the interpreter (default python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
LIMIT=$((64 * 1024 * 1024))
MARGIN=$((3 * 1000 * 1000))  # the tree may grow a little before the commands are run

tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
untracked=$(git ls-files -z --others --exclude-standard | xargs -0 -r du -cb | tail -1 | cut -f1)
part=${PART_BYTES:-$((LIMIT - tree - ${untracked:-0} - MARGIN))}  # PART_BYTES: a smaller part, if a command's files are refused as too large
[ "$part" -gt $((8 * 1000 * 1000)) ] || { echo "error: the tracked tree ($tree bytes) leaves no room for a payload in 64 MiB" >&2; exit 1; }

rm -rf .gpu && mkdir -p .gpu/stage/wheels
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude

# transformers as tested here, with the huggingface_hub it requires (transformers 5.25 refuses to import
# beside huggingface_hub 1.x) and that hub's own needs, each at the version installed here.
pinned='import importlib.metadata as m; print(" ".join(f"{n}=={m.version(n)}" for n in "transformers huggingface-hub httpx2 httpcore2 truststore hf-xet click".split()))'
# Wheels for the machine's Python 3.12. All are pure Python; antlr4 4.9.3 (what
# omegaconf 2.3 pins) is published only as a source archive, so it is built here.
$PY -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/stage/wheels $($PY -c "$pinned") hydra-core==1.3.8 omegaconf==2.3.1 gguf==0.19.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
$PY -m pip wheel --quiet --no-deps -w .gpu/stage/wheels antlr4-python3-runtime==4.9.3

gguf=$($PY -c 'from harness.models.embedded import find_gguf; print(find_gguf())')
name=$(basename "$gguf")
(cd "$(dirname "$gguf")" && sha256sum "$name") > .gpu/stage/SHA256SUMS
split -b $((part - 2 * 1000 * 1000)) -d -a 2 "$gguf" ".gpu/stage/$name.part-"  # room beside a part for the checksum and small wheels

# Fill the part folders in order, each up to `part` bytes.
n=1; used=0; mkdir -p .gpu/1
for f in .gpu/stage/SHA256SUMS .gpu/stage/*.part-* .gpu/stage/wheels/*.whl; do  # the checksum first: the last command checks that every part came
    size=$(stat -c %s "$f")
    if [ $((used + size)) -gt "$part" ]; then n=$((n + 1)); used=0; mkdir -p ".gpu/$n"; fi
    case "$f" in *.whl) mkdir -p ".gpu/$n/wheels"; mv "$f" ".gpu/$n/wheels/" ;; *) mv "$f" ".gpu/$n/" ;; esac
    used=$((used + size))
done
rm -rf .gpu/stage
git describe --always --dirty --abbrev=12 > ".gpu/$n/COMMIT"  # the machine gets the tree without .git: the figures name their code

echo "payload: $n parts, each copied over beside the tracked tree ($tree bytes), at most $part bytes:"
du -sb .gpu/* | sed 's/^/  /'
for i in $(seq 1 "$n"); do
    if [ "$i" -lt "$n" ]; then run=""; else run=" --run"; fi
    echo "  command $i, with .gpu/$i copied over: bash scripts/gpu_check.sh --stash .gpu/$i$run"
done
echo "  run them one after another on the same machine, the last with 10 minutes to spare. With less time left,"
echo "  add --seconds S to the last command, S = its seconds left minus 60 (the check writes each part as it finishes)."
