# Sourced by the device scripts: NCCL for the NCCL transport, the toolkit's, else the nvidia-nccl
# wheel's next to PyTorch (NCCL_HOME for the build, LD_LIBRARY_PATH for the binaries).
if [ -z "${NCCL_HOME:-}" ] && [ ! -f /usr/local/cuda/include/nccl.h ]; then
  NCCL_HOME=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null || true)
  export NCCL_HOME
  if [ -n "$NCCL_HOME" ]; then export LD_LIBRARY_PATH="$NCCL_HOME/lib:${LD_LIBRARY_PATH:-}"; fi
fi
