# CPU image by default:      docker build -t swarmrun .
# CUDA image:                docker build -t swarmrun:cuda --build-arg BASE=nvidia/cuda:12.4.1-runtime-ubuntu22.04 \
#                                --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 .
# Run a peer:                docker run --rm -it --network host swarmrun join my-run --task char-lm --listen /ip4/0.0.0.0/tcp/31337
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN if ! command -v python3 >/dev/null; then apt-get update && apt-get install -y --no-install-recommends python3 python3-pip && rm -rf /var/lib/apt/lists/*; fi
WORKDIR /opt/swarmrun
COPY pyproject.toml README.md ./
COPY swarmrun ./swarmrun
RUN python3 -m pip install --index-url ${TORCH_INDEX} "torch>=2.1" && python3 -m pip install .
VOLUME /root/.swarmrun
ENTRYPOINT ["node"]
CMD ["--help"]
