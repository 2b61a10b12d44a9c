# syntax=docker/dockerfile:1
# megainfer's image, CPU or CUDA from this one file (docs/deploy-k8s.md):
#
#   docker build -t megainfer:cpu .                                   # torch's CPU build
#   docker build --build-arg VARIANT=cuda -t megainfer:cuda .         # torch's CUDA build (cu128 wheels)
#   docker build --build-arg VARIANT=cuda --build-arg CUDA=cu130 .    # another CUDA wheel set
#
#   docker run --rm -p 50051:50051 -p 8000:8000 -p 9100:9100 megainfer:cpu     # serves the demo model
#   docker run --rm --gpus all -v /data/models:/models:ro -p 8000:8000 megainfer:cuda \
#       serve --model /models/my-moe --host 0.0.0.0 --http-host 0.0.0.0 --http-port 8000
#
# Both variants start from the same slim Python: the CUDA build of torch brings its CUDA
# libraries as wheels, so the host needs only the NVIDIA driver (and the container toolkit).

ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11-slim

# megainfer as a wheel, built apart so the sources stay out of the final image.
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY megainfer/ megainfer/
COPY transport/ transport/
COPY kernels/ kernels/
COPY planner/ planner/
COPY deploy/ deploy/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS torch-cpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
    MEGAINFER_EXTRAS=""

FROM ${PYTHON_IMAGE} AS torch-cuda
ARG CUDA=cu128
# gpu: pynvml for the energy meter and Triton for the kernels.
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/${CUDA} \
    MEGAINFER_EXTRAS="[gpu]" \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
# A C compiler: Triton builds its CUDA launcher (triton/backends/nvidia/driver.c) with gcc at
# its first launch; without one no Triton kernel runs. gcc brings stddef.h/stdbool.h,
# libc6-dev stdio.h/dlfcn.h, the python image Python.h, Triton its own cuda.h.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch-cpu or torch-cuda above (hadolint cannot see that the name is a stage's).
# hadolint ignore=DL3006
FROM torch-${VARIANT}
ARG TORCH_VERSION=2.13.0
# PROMETHEUS_DISABLE_CREATED_SERIES: no `_created` twin of each counter and histogram, as vLLM
# exposes them, so a vLLM dashboard sees the same series.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PROMETHEUS_DISABLE_CREATED_SERIES=true \
    HF_HOME=/home/megainfer/.cache/huggingface

# wget: KubeRay's default probes of Ray worker pods call it.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/*

# torch first, from its own index (README: torch==2.13.0), so megainfer's `torch>=2.4` finds it installed.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/megainfer-*.whl)${MEGAINFER_EXTRAS}" \
    && rm -rf /wheels

RUN useradd --create-home --uid 1000 --shell /bin/bash megainfer \
    && mkdir -p /models \
    && chown megainfer:megainfer /models
# Numeric, so Kubernetes' runAsNonRoot can check it.
USER 1000:1000
WORKDIR /home/megainfer

# Checkpoints: mount a directory of Hugging Face checkpoints here (read-only is enough).
VOLUME ["/models"]
# gRPC (megainfer.v1.Inference and grpc.health.v1), HTTP (OpenAI API, /health, /metrics), Prometheus.
EXPOSE 50051 8000 9100

ENTRYPOINT ["megainfer"]
# device auto: the GPU in the CUDA image where the container sees one, else the CPU.
CMD ["serve", "--model", "megainfer-demo", "--device", "auto", "--host", "0.0.0.0", "--port", "50051", \
     "--http-host", "0.0.0.0", "--http-port", "8000", "--metrics-port", "9100"]
