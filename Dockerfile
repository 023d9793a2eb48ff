# syntax=docker/dockerfile:1
# One image for the three programs: gpufence-webhook (Deployment), gpufence-enforcer (the sidecar
# the webhook injects into GPU pods) and gpufence-certs (certificate Job/CronJob).
#
#   docker build -t ghcr.io/gpufence/gpufence:0.1.0 .
#
# The target "enforcer" is a sidecar-only image: the project with only the enforcer's runtime
# dependencies (requirements/enforcer.txt: pynvml and prometheus-client, locked with their hashes
# in requirements/enforcer.lock; about 3.4 MiB with their bytecode, against about 185 MiB with the
# webhook's aiohttp, cryptography and kubernetes client).
# Point the webhook's --sidecar-image at it (docs/PERFORMANCE.md, "The sidecar in a pod"):
#
#   docker build --target enforcer -t ghcr.io/gpufence/gpufence-enforcer:0.1.0 .
#
# Bytecode: containers run with a read-only root and PYTHONDONTWRITEBYTECODE, so a module without a
# valid .pyc is compiled again at every start (for the CPU-limited sidecar, most of its start-up).
# Both images compile the standard library and /opt/gpufence against hashes, unchecked at import:
# valid whatever the layers' file times (a builder that rewrites them, or a base image without
# .pyc files), and the sources in an image never change.
#
# The build stage makes a wheel of this project and installs it, with only its runtime
# dependencies at the versions and hashes of requirements/runtime.lock (pip-compile; the test
# extra is never installed), into a virtualenv at /opt/gpufence. The final stage copies that
# virtualenv onto a fresh python:3.11-slim: no pip, no compiler, no build dependencies. Both stages use the same base
# image so the virtualenv's interpreter symlink resolves.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
COPY requirements/runtime.lock requirements/runtime.lock
COPY pyproject.toml README.md ./
COPY gpufence/ gpufence/
RUN python -m pip wheel --no-deps --wheel-dir /dist . \
 && python -m venv /opt/gpufence \
 && /opt/gpufence/bin/pip install --require-hashes -r requirements/runtime.lock \
 && /opt/gpufence/bin/pip install --no-deps /dist/gpufence-*.whl \
 && for script in gpufence-webhook gpufence-enforcer gpufence-certs gpufence-node; do \
        test -x "/opt/gpufence/bin/$script" || { echo "missing console script $script" >&2; exit 1; }; \
    done \
 && /opt/gpufence/bin/pip uninstall --yes pip setuptools \
 && /opt/gpufence/bin/python -m compileall -q -f --invalidation-mode unchecked-hash /opt/gpufence/lib

FROM ${PYTHON_IMAGE} AS build-enforcer
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
COPY requirements/enforcer.lock /src/requirements/
COPY --from=build /dist /dist
RUN python -m venv /opt/gpufence \
 && /opt/gpufence/bin/pip install --no-deps /dist/gpufence-*.whl \
 && /opt/gpufence/bin/pip install --require-hashes -r /src/requirements/enforcer.lock \
 && test -x /opt/gpufence/bin/gpufence-enforcer \
 && /opt/gpufence/bin/pip uninstall --yes pip setuptools \
 && /opt/gpufence/bin/python -m compileall -q -f --invalidation-mode unchecked-hash /opt/gpufence/lib

FROM ${PYTHON_IMAGE} AS enforcer
LABEL org.opencontainers.image.title="gpufence-enforcer" \
      org.opencontainers.image.description="gpufence's per-pod GPU share enforcer (the sidecar the webhook injects)" \
      org.opencontainers.image.source="https://github.com/gpufence/gpufence" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build-enforcer /opt/gpufence /opt/gpufence
RUN python -m compileall -q -f --invalidation-mode unchecked-hash \
        "$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"
ENV PATH=/opt/gpufence/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# The webhook sets the sidecar's user (see below); non-root when run otherwise.
USER 65532:65532
WORKDIR /tmp
CMD ["gpufence-enforcer", "--help"]

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gpufence" \
      org.opencontainers.image.description="GPU sharing with isolation on Kubernetes: admission webhook, enforcer sidecar, certificate tool" \
      org.opencontainers.image.source="https://github.com/gpufence/gpufence" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/gpufence /opt/gpufence
RUN python -m compileall -q -f --invalidation-mode unchecked-hash \
        "$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"
# Root filesystems are mounted read-only in the manifests: no .pyc writes, unbuffered JSON logs.
ENV PATH=/opt/gpufence/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Non-root by default (uid/gid 65532, the conventional "nonroot"). The webhook Deployment and the
# certificate Jobs also set runAsUser 65532 themselves.
# The enforcer sidecar is different: the webhook runs it as the pod's user when the pod sets a
# pod-level runAsUser (same uid as the workloads: no capability needed), otherwise as uid 0 with
# every capability dropped except KILL and SYS_PTRACE (Kubernetes makes added capabilities
# effective only for root). See docs/install.md, "Which user the sidecar runs as".
USER 65532:65532
WORKDIR /tmp
# No ENTRYPOINT: each manifest names its program (command: ["gpufence-webhook"], ...).
CMD ["gpufence-webhook", "--help"]
