# CPU image by default:      docker build -t swarmrun .
# CUDA image:                docker build -t swarmrun:cuda --build-arg BASE=nvidia/cuda:12.4.1-runtime-ubuntu22.04 \
#                                --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 .
# Run a peer (keep its identity and the run's owner key in a named volume: with --rm and no volume they would
# leave with the container, and with them pause, invite and amendments):
#   docker run --rm -it --network host -v swarmrun-state:/home/swarmrun/.swarmrun swarmrun \
#       join my-run --task char-lm --listen /ip4/0.0.0.0/tcp/31337
# Every image pins one torch (TORCH_VERSION), and char-lm's default corpus is swarmrun's own sources, so a CPU and
# a CUDA image of the same swarmrun accept each other's runs.
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN if ! command -v python3 >/dev/null; then apt-get update && apt-get install -y --no-install-recommends python3 python3-pip && rm -rf /var/lib/apt/lists/*; fi
WORKDIR /opt/swarmrun
COPY pyproject.toml README.md ./
COPY swarmrun ./swarmrun
RUN python3 -m pip install --index-url ${TORCH_INDEX} "torch==${TORCH_VERSION}" && python3 -m pip install .
RUN useradd --create-home --uid 1000 swarmrun
USER swarmrun
VOLUME /home/swarmrun/.swarmrun
ENTRYPOINT ["node"]
CMD ["--help"]
