# Tandem's serving image: `tandem` as the entrypoint, the default model (models/tandem-tiny) inside, a non-root user.
#   make image                        CPU torch, tag tandem:<version>-cpu
#   make image TORCH_VARIANT=cuda     CUDA torch from PyPI plus the [gpu] extra (fla-core), tag tandem:<version>-cuda
# Build arguments:
#   BASE_IMAGE      the Python image both stages start from (python3, its venv module and pip on PATH)
#   TORCH_VARIANT   cpu (PyTorch's CPU wheel index) or cuda (PyPI's torch, which is the CUDA build, and [gpu])
#   TORCH_VERSION   the torch release to install
# Offline or behind a proxy:
#   --build-context wheels=DIR    install torch from the wheels in DIR instead of an index
#   --secret id=pip-ca,src=FILE   a CA bundle for pip (a TLS-intercepting proxy); used by the build, not kept
ARG BASE_IMAGE=python:3.11-slim

# The wheel directory torch comes from when the build is handed one; empty otherwise.
FROM scratch AS wheels

FROM ${BASE_IMAGE} AS build
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/venv
# torch first and alone: its own layer, kept while only Tandem's code changes
RUN --mount=type=bind,from=wheels,target=/wheels --mount=type=secret,id=pip-ca \
    set -eu; \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    case "$TORCH_VARIANT" in \
      cpu) req="torch==${TORCH_VERSION}+cpu"; src="--index-url ${TORCH_CPU_INDEX}" ;; \
      cuda) req="torch==${TORCH_VERSION}"; src="" ;; \
      *) echo "TORCH_VARIANT must be cpu or cuda, not '${TORCH_VARIANT}'" >&2; exit 2 ;; \
    esac; \
    if ls /wheels/torch-*.whl >/dev/null 2>&1; then src="--find-links /wheels"; fi; \
    /opt/venv/bin/pip install $src "$req"
WORKDIR /opt/tandem
# Tandem's dependencies, from pyproject.toml alone: no source in this stage, so a code change rebuilds none of them
# (setuptools too: the final stage installs the package without fetching its build backend)
COPY pyproject.toml ./
RUN --mount=type=secret,id=pip-ca \
    set -eu; \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    extra=""; if [ "$TORCH_VARIANT" = cuda ]; then extra="[gpu]"; fi; \
    /opt/venv/bin/pip install -e ".${extra}" "setuptools>=68"

FROM ${BASE_IMAGE}
# uid/gid 10001: the manifests' runAsUser; numeric USER lets Kubernetes check runAsNonRoot
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin tandem
# CUDA: Triton compiles its kernel launchers when serving, with a C compiler against Python's headers (Debian's
# python3 keeps them in python3-dev; the official Python images ship them)
ARG TORCH_VARIANT=cpu
RUN set -eu; \
    if [ "$TORCH_VARIANT" = cuda ]; then \
      pkgs="gcc libc6-dev"; \
      include=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])'); \
      if [ ! -e "$include/Python.h" ]; then pkgs="$pkgs python3-dev"; fi; \
      apt-get update && apt-get install -y --no-install-recommends $pkgs && rm -rf /var/lib/apt/lists/*; \
    fi
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /opt/tandem
COPY models/tandem-tiny models/tandem-tiny
COPY pyproject.toml ./
COPY tandem tandem
COPY router router
COPY prefill_worker prefill_worker
COPY decode_worker decode_worker
# Editable: the package finds its default model at ../models/tandem-tiny beside its source, so the source stays here
# rather than moving into site-packages. Offline: no dependencies, the venv's setuptools as the build backend.
RUN pip install --no-deps --no-build-isolation --no-cache-dir --disable-pip-version-check -e . \
    && python -m compileall -q /opt/tandem
USER 10001:10001
WORKDIR /home/tandem
# router gRPC, OpenAI HTTP, router /metrics (`tandem serve`'s defaults)
EXPOSE 50051 8000 9090
ENTRYPOINT ["tandem"]
# all interfaces: reachable through the container's published ports
CMD ["serve", "--host", "0.0.0.0"]
