#!/usr/bin/env bash
# Run scripts/gpu_check_transformers.py on a GPU machine that has torch (a CUDA build) and
# transformers but no network and no install of this project.
#
#   scripts/gpu_check_offline.sh bundle          # here, where the package index is reachable
#   scripts/gpu_check_offline.sh check [ARGS]    # there, from a copy of the repository root
#   scripts/gpu_check_offline.sh bench NAME OUT [--quick]   # there: one benchmark module (no plots)
#
# `bundle` puts the pure-Python packages such a machine may lack (anyio, trio, skyrl-gym and what
# they need) into $DEPS (default build/gpu-deps, about 6 MB; copy it along with the checkout).
# `check` and `bench` append that folder to the end of sys.path, so whatever the machine already
# has wins, print the versions in use, then run the checks (ARGS go to gpu_check_transformers.py)
# or one benchmark of benchmarks/ (NAME as in `python -m benchmarks --only`, results in OUT).
set -euo pipefail
cd "$(dirname "$0")/.."
DEPS=${DEPS:-build/gpu-deps}
PYTHON=${PYTHON:-python}
PURE=(anyio sniffio idna skyrl-gym==0.4.0 func_timeout "omegaconf>=2.2,<3" antlr4-python3-runtime==4.9.3
    trio outcome attrs sortedcontainers requests urllib3 certifi charset-normalizer)
# skyrl_gym imports pandas at import time: wheels for CPython 3.11-3.13, unpacked there if missing.
PANDAS=pandas==3.1.1

run_with_deps() {
    "$PYTHON" - "$DEPS" "$@" <<'EOF'
import glob, os, platform, runpy, sys, tempfile, zipfile

deps, mode, *args = sys.argv[1:]
sys.path.insert(0, os.getcwd())
sys.path.append(os.path.abspath(deps))
try:
    import pandas  # noqa: F401
except ImportError:
    # A wheel is a zip of an installed package: unpack this interpreter's pandas and its pure deps.
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    unpacked = tempfile.mkdtemp(prefix="gpu-deps-pandas-")
    for wheel in glob.glob(os.path.join(deps, "wheels", "*.whl")):
        name = os.path.basename(wheel)
        if name.startswith("pandas-") and f"-{tag}-" not in name:
            continue
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(unpacked)
    sys.path.append(unpacked)
import anyio, skyrl_gym, torch, transformers, trio  # fail here, before any check starts

device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print(
    f"python {platform.python_version()}; torch {torch.__version__} (CUDA {torch.version.cuda}, {device}); "
    f"transformers {transformers.__version__}; trio {trio.__version__}",
    flush=True,
)
if mode == "check":
    sys.argv = ["scripts/gpu_check_transformers.py", *args]
    runpy.run_path("scripts/gpu_check_transformers.py", run_name="__main__")
else:  # one benchmark module, without the plots (matplotlib is not assumed there)
    import importlib, json, pathlib
    from benchmarks.harness import Context
    from benchmarks.tokenizer import load_tokenizer

    name, out = args[0], pathlib.Path(args[1])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, tokenizer_name = load_tokenizer("auto")
    ctx = Context(quick="--quick" in args, out_dir=out, tokenizer=tokenizer, tokenizer_name=tokenizer_name)
    payload = importlib.import_module(f"benchmarks.{name}").run(ctx)
    print(json.dumps(payload, indent=1, default=str)[:6000])
EOF
}

case "${1:-}" in
    bundle)
        rm -rf "$DEPS"
        "$PYTHON" -m pip install --quiet --no-deps --no-compile --target "$DEPS" "${PURE[@]}"
        for version in 3.11 3.12 3.13; do
            "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" \
                --platform manylinux_2_28_x86_64 --dest "$DEPS/wheels" "$PANDAS"
        done
        "$PYTHON" -m pip download --quiet --no-deps --dest "$DEPS/wheels" python-dateutil six tzdata
        du -sh "$DEPS"
        ;;
    check | bench)
        mode=$1
        shift
        run_with_deps "$mode" "$@"
        ;;
    *)
        echo "usage: $0 bundle | check [ARGS] | bench [ARGS]" >&2
        exit 2
        ;;
esac
