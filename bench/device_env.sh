# Sourced by the scripts a session runs on the lent device (bench/run_gpu.sh, bench/run_wan_cores.sh), after
# `bash bench/prepare_gpu.sh` here: installs the carried wheels (.whl) into /tmp/site, puts them and the tree on
# PYTHONPATH, exports the commit prepare_gpu.sh recorded as SPES_COMMIT (the device gets the tree without .git),
# and checks spes imports. Sets OUT (the device's $OUT, else bench/results) and PY (python3, or $PYTHON).
OUT=${OUT:-bench/results}
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "error: installing the carried wheels failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  [ -f .whl/COMMIT ] && export SPES_COMMIT=$(cat .whl/COMMIT)
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
"$PY" -c "import omegaconf, torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" || {
  echo "error: spes cannot be imported here: run 'bash bench/prepare_gpu.sh' on the development machine and carry .whl"
  exit 1
}
