# syntax=docker/dockerfile:1.7
# The kit's image: every framework of the comparison on one pinned CUDA PyTorch base.
# Build with `make image BASE_DIGEST=sha256:...` (docs/containers.md); lint: tests/test_containers.py.
#
# Base: pytorch/pytorch:2.14.1-cuda13.0-cudnn9-devel (Ubuntu 24.04, system Python 3.12, no conda).
#   - torch 2.14.1+cu130: the very version requirements.txt pins, so `make install-requirements`
#     keeps the base's torch instead of downloading a second one, and CI and the image run the same
#     torch. Its wheel dependencies bring the CUDA 13.0 runtime, cuDNN 9 and NCCL 2.30 (nvidia-nccl-cu13),
#     the same libraries as CI's torch wheel; `repro doctor` prints the versions it finds.
#   - the devel variant adds nvcc 13.0, which DeepSpeed needs to compile its CUDA ops below.
#   - Not an NGC release: those carry NVIDIA's own torch builds (2.x.0a0+nv..), which requirements.txt
#     cannot pin, so the image and CI would train with different torch code.
#   - CUDA 13 no longer supports Volta (sm_70): the paper's V100s need a CUDA 12 base.
# The digest is a required build argument: no digest of this tag could be looked up where this file
# was written (no registry access), and a made-up one would pin nothing. `make image` prints how to
# look it up; the image records it in its labels.
ARG BASE_IMAGE=pytorch/pytorch:2.14.1-cuda13.0-cudnn9-devel
ARG BASE_DIGEST
# LBANN takes hours to build: WITH_LBANN=0 leaves it out (`repro list` then shows it unavailable).
ARG WITH_LBANN=1
ARG LBANN_VERSION=0.104
# Spack v0.23.1: the last release that bundles its package recipes, lbann@0.104's among them.
ARG SPACK_COMMIT=2bfcc69fa870d3c6919be87593f22647981b648a

FROM ${BASE_IMAGE}@${BASE_DIGEST} AS base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive
# make runs the kit's install targets; g++ compiles DeepSpeed's ops and LBANN; git fetches Spack.
RUN apt-get update \
    && apt-get install -y --no-install-recommends make g++ git ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# ---- LBANN 0.104, built by Spack in a stage of its own ----------------------------------------------
# It depends on the base only, so editing the kit never rebuilds it.
FROM base AS lbann-1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG LBANN_VERSION
ARG SPACK_COMMIT
ARG SOURCE_DATE_EPOCH
ARG TORCH_CUDA_ARCH_LIST="8.0;9.0"
RUN apt-get update \
    && apt-get install -y --no-install-recommends gfortran file unzip xz-utils bzip2 patch \
    && rm -rf /var/lib/apt/lists/*
RUN git init --quiet /opt/spack \
    && git -C /opt/spack fetch --quiet --depth 1 https://github.com/spack/spack.git "${SPACK_COMMIT}" \
    && git -C /opt/spack checkout --quiet FETCH_HEAD
COPY docker/lbann/spack.yaml /opt/lbann/spack.yaml
# cuda_arch: the same architectures as the kit ("8.0;9.0" -> 80,90). The front end's `lbann` package
# is linked where the kit's Python finds it (/opt/lbann/frontend) without LBANN's other packages.
RUN . /opt/spack/share/spack/setup-env.sh \
    && spack compiler find \
    && cuda_arch="$(echo "${TORCH_CUDA_ARCH_LIST}" | tr -d '.' | tr ';' ',')" \
    && spack -e /opt/lbann add "lbann@${LBANN_VERSION} +cuda cuda_arch=${cuda_arch} +vision +pfe" \
    && spack -e /opt/lbann concretize \
    && spack -e /opt/lbann install --fail-fast \
    && spack -e /opt/lbann gc --yes-to-all \
    && spack clean --all \
    && mkdir /opt/lbann/frontend \
    && ln -s "$(/opt/lbann/view/bin/python3 -c 'import lbann, os; print(os.path.dirname(lbann.__file__))')" \
        /opt/lbann/frontend/lbann

# Without LBANN: an empty /opt/lbann.
FROM base AS lbann-0
RUN mkdir -p /opt/lbann

# DL3006 (tag the image): lbann-0 and lbann-1 are this file's own stages, which carry no tag.
# hadolint ignore=DL3006
FROM lbann-${WITH_LBANN} AS lbann

# ---- the kit and its Python dependencies, installed the way CI installs them -----------------------
FROM base AS kit
# GPU architectures to compile CUDA code for (A100 and H100/H200 by default).
ARG TORCH_CUDA_ARCH_LIST="8.0;9.0"
# Build steps see it as an environment variable: wheels built here get the commit's timestamps.
ARG SOURCE_DATE_EPOCH
# DeepSpeed prebuilds the ops ZeRO uses (fused and CPU Adam, fused LAMB, flatten utilities), so no
# rank compiles them at run time. The build has no GPU, so the accelerator is named, not detected.
ENV TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} DS_ACCELERATOR=cuda \
    DS_BUILD_FUSED_ADAM=1 DS_BUILD_CPU_ADAM=1 DS_BUILD_FUSED_LAMB=1 DS_BUILD_UTILS=1 \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# A virtual environment that sees the base's packages: torch comes from the base, the rest from pip.
RUN python3 -m venv --without-pip --system-site-packages /opt/venv
WORKDIR /src
# Dependencies first and source second, in two layers, so that editing the kit does not recompile
# DeepSpeed: the two targets are exactly what `make install` runs in CI.
# DeepSpeed builds its ops only when its setup can import torch: no build isolation for this step
# (PIP_NO_BUILD_ISOLATION=0 is pip's spelling of --no-build-isolation).
COPY requirements.txt Makefile ./
RUN PIP_NO_BUILD_ISOLATION=0 make install-requirements PYTHON=/opt/venv/bin/python
COPY pyproject.toml README.md ./
COPY repro ./repro
# Then the smoke image set, staged read-only in the image so a first run needs no data.
RUN make install-kit PYTHON=/opt/venv/bin/python EDITABLE= \
    && REPRO_DATA=/opt/repro/data /opt/venv/bin/repro data prepare digits

# ---- the image users run ---------------------------------------------------------------------------
FROM base AS runtime
ARG BASE_IMAGE
ARG BASE_DIGEST
ARG TORCH_CUDA_ARCH_LIST="8.0;9.0"
ARG REPRO_IMAGE=repro:dev
ARG REPRO_GIT_SHA=unknown
ARG WITH_LBANN
ARG LBANN_VERSION
ARG SPACK_COMMIT
# Versions of every framework, equal to requirements.txt (tests/test_containers.py checks it).
LABEL org.opencontainers.image.title="repro" \
      org.opencontainers.image.description="Re-run the evaluation of parallel deep-learning frameworks (Nichols et al., 2021)" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.revision="${REPRO_GIT_SHA}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      org.opencontainers.image.base.digest="${BASE_DIGEST}" \
      io.repro.python="3.12" \
      io.repro.cuda="13.0" \
      io.repro.cuda-arch-list="${TORCH_CUDA_ARCH_LIST}" \
      io.repro.torch="2.14.1" \
      io.repro.torchvision="0.29.1" \
      io.repro.deepspeed="0.19.8" \
      io.repro.deepspeed-ops="fused_adam,cpu_adam,fused_lamb,utils" \
      io.repro.megatron-core="0.16.1" \
      io.repro.torchgpipe="0.0.7" \
      io.repro.datasets="5.2.0" \
      io.repro.mlflow="3.17.2" \
      io.repro.lbann="${LBANN_VERSION}" \
      io.repro.with-lbann="${WITH_LBANN}" \
      io.repro.spack-commit="${SPACK_COMMIT}"
COPY --from=kit /opt/venv /opt/venv
COPY --from=kit /opt/repro/data /opt/repro/data
COPY --from=lbann /opt/lbann /opt/lbann
COPY configs /opt/repro/configs
# With LBANN: its front end visible to the kit's Python (found, not imported: the driver runs it
# under LBANN's own Python, LBANN_PYTHON), and its programs (lbann, mpirun, srun's MPI) on PATH.
RUN if [ -d /opt/lbann/frontend ]; then \
        echo /opt/lbann/frontend > "$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/lbann-frontend.pth"; \
    fi
# REPRO_IMAGE and REPRO_GIT_SHA: `repro doctor` reports them and every run is tagged with them.
ENV PATH=/opt/venv/bin:${PATH}:/opt/lbann/view/bin \
    VIRTUAL_ENV=/opt/venv \
    LBANN_PYTHON=/opt/lbann/view/bin/python3 \
    PYTHONNOUSERSITE=1 \
    PYTHONUNBUFFERED=1 \
    REPRO_IMAGE=${REPRO_IMAGE} \
    REPRO_GIT_SHA=${REPRO_GIT_SHA} \
    REPRO_CONFIGS=/opt/repro/configs \
    REPRO_STAGED_DATA=/opt/repro/data \
    REPRO_DATA=/data
# Ubuntu 24.04 already has uid 1000 (ubuntu); runs and data go to /work and /data (volumes).
RUN useradd --create-home --uid 10001 --user-group repro \
    && mkdir -p /work/runs /data \
    && chown -R repro:repro /work /data
USER 10001:10001
WORKDIR /work
ENTRYPOINT ["repro"]
CMD ["--help"]
