# The kit's image: every framework of the comparison on one pinned base, addressed by digest.
# Build with `make image BASE_DIGEST=sha256:...` (docs/containers.md): it also labels the image with
# what the build really produced (docker/labels.py). Lint and build tests: tests/test_containers.py,
# tests/test_image.py. No `# syntax=` line: Docker's built-in frontend builds this file, so air-gapped
# sites need no frontend image from Docker Hub.
#
# Base: any image with python3 (3.10 or later) and apt, with or without torch.
#   - Default pytorch/pytorch:2.14.1-cuda13.0-cudnn9-devel: torch 2.14.1+cu130, the version
#     requirements.txt pins, so the pip step keeps the base's torch; its devel variant brings nvcc
#     for DeepSpeed's CUDA ops.
#   - A plain distribution or CUDA base works too: torch then comes from requirements.txt (PyPI's
#     wheel, with its CUDA runtime, cuDNN and NCCL). tests/test_image.py builds from a Debian base.
#   - Volta (V100): CUDA 13 dropped sm_70; docs/containers.md gives the arguments for a CUDA 12 torch.
# The digest is a required build argument: a tag alone pins nothing.
ARG BASE_IMAGE=pytorch/pytorch:2.14.1-cuda13.0-cudnn9-devel
ARG BASE_DIGEST
# LBANN takes hours to build: WITH_LBANN=0 leaves it out (`repro list` then says it is not in this image).
ARG WITH_LBANN=1
ARG LBANN_VERSION=0.104
# Spack v0.23.1: the last release that bundles its package recipes, lbann@0.104's among them.
ARG SPACK_COMMIT=2bfcc69fa870d3c6919be87593f22647981b648a

FROM ${BASE_IMAGE}@${BASE_DIGEST} AS base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive

# ---- LBANN 0.104, built by Spack in a stage of its own ----------------------------------------------
# It depends on the base only, so editing the kit never rebuilds it.
FROM base AS lbann-1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG LBANN_VERSION
ARG SPACK_COMMIT
ARG SOURCE_DATE_EPOCH
ARG TORCH_CUDA_ARCH_LIST="8.0;9.0"
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ git make gfortran file unzip xz-utils bzip2 patch \
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
    && printf 'lbann=%s\nspack-commit=%s\n' "${LBANN_VERSION}" "${SPACK_COMMIT}" > /opt/lbann/build-info \
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
# DeepSpeed's ops to prebuild, so no rank compiles them at run time; CUDA ops (fused_adam,
# fused_lamb) need nvcc in the base. The build has no GPU, so the accelerator is named, not detected
# (DS_ACCELERATOR=cpu for a base without CUDA, with DEEPSPEED_OPS="cpu_adam shm_comm": ZeRO's
# collectives on CPU load shm_comm, which the runtime stage cannot compile). docker/labels.py lists
# the ops really built.
ARG DEEPSPEED_OPS="cpu_adam fused_adam fused_lamb utils"
ARG DS_ACCELERATOR=cuda
# The CPU the compiled ops target: DeepSpeed asks for the build machine's (-march=native, AVX-512
# when it has it); docker/target-cxx replaces that with this portable target (x86-64-v3: AVX2).
ARG CPU_TARGET="-march=x86-64-v3 -D__AVX256__"
# Wikitext-2 fetched from the Hugging Face Hub into the image (needs the Hub; docs/containers.md
# adds it offline instead). Digits are generated, so they are always staged.
ARG STAGE_WIKITEXT=0
ENV TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} DS_ACCELERATOR=${DS_ACCELERATOR} \
    CC=/usr/local/bin/target-cc CXX=/usr/local/bin/target-cxx REPRO_CPU_TARGET=${CPU_TARGET} \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Build tools, in this stage only: make runs the install targets, g++ compiles DeepSpeed's ops against
# Python.h (python3-dev when the base's Python lacks its headers), python3-venv when it lacks ensurepip.
RUN include="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
    && apt-get update \
    && apt-get install -y --no-install-recommends make g++ \
    && { [ -f "${include}/Python.h" ] || apt-get install -y --no-install-recommends python3-dev; } \
    && { python3 -c 'import ensurepip' 2>/dev/null || apt-get install -y --no-install-recommends python3-venv; } \
    && rm -rf /var/lib/apt/lists/* \
    && test -f "${include}/Python.h"
COPY docker/target-cxx docker/target-cc /usr/local/bin/
# A virtual environment that sees the base's packages: a base's torch is kept, pip brings the rest.
RUN python3 -m venv --system-site-packages /opt/venv
WORKDIR /src
# Dependencies first and source second, in two layers, so that editing the kit does not recompile
# DeepSpeed: the two targets are exactly what `make install` runs in CI.
# DeepSpeed builds its ops only when its setup can import torch: no build isolation for this step
# (PIP_NO_BUILD_ISOLATION=0 is pip's spelling of --no-build-isolation).
# The optional secret `ca` is a CA bundle for sites that inspect TLS: pip trusts it for this step
# only, and it is never written to a layer.
COPY requirements.txt Makefile ./
COPY docker/with-ca /usr/local/bin/with-ca
# SC3059 (case modification is not POSIX): the shell is bash (SHELL of the base stage, inherited).
# hadolint ignore=SC3059
RUN --mount=type=secret,id=ca \
    for op in ${DEEPSPEED_OPS}; do export "DS_BUILD_${op^^}=1"; done \
    && PIP_NO_BUILD_ISOLATION=0 with-ca make install-requirements PYTHON=/opt/venv/bin/python
COPY pyproject.toml README.md ./
COPY repro ./repro
# The kit's wheel gets the commit's timestamps; declared here, after the dependency layer, so that a
# new commit does not invalidate it.
ARG SOURCE_DATE_EPOCH
# Then the smoke data, staged read-only in the image so a first run needs no data.
RUN --mount=type=secret,id=ca \
    with-ca make install-kit PYTHON=/opt/venv/bin/python EDITABLE= \
    && export REPRO_DATA=/opt/repro/data REPRO_STAGED_DATA=/nonexistent \
    && /opt/venv/bin/repro data prepare digits \
    && if [ "${STAGE_WIKITEXT}" = 1 ]; then with-ca /opt/venv/bin/repro data prepare wikitext-2; fi \
    && rm -rf /opt/repro/data/.cache

# ---- the image users run: the kit's venv on the bare base, no compilers or test tools ---------------
FROM base AS runtime
ARG BASE_IMAGE
ARG BASE_DIGEST
ARG TORCH_CUDA_ARCH_LIST="8.0;9.0"
ARG REPRO_IMAGE=repro:dev
ARG REPRO_GIT_SHA=unknown
# What the build was asked for; `make image` adds labels for what it produced (docker/labels.py:
# Python, torch, CUDA, cuDNN, every pinned framework, DeepSpeed's built ops, LBANN when built).
LABEL org.opencontainers.image.title="repro" \
      org.opencontainers.image.description="Re-run the evaluation of parallel deep-learning frameworks (Nichols et al., 2021)" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.revision="${REPRO_GIT_SHA}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      org.opencontainers.image.base.digest="${BASE_DIGEST}" \
      io.repro.cuda-arch-list="${TORCH_CUDA_ARCH_LIST}"
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
# Everything a run writes (data/, runs/, reports/, mlflow.db, mlruns/, caches) goes to the working
# directory: mount a host folder there, or let Apptainer use the current one (docs/containers.md).
ENV PATH=/opt/venv/bin:${PATH}:/opt/lbann/view/bin \
    VIRTUAL_ENV=/opt/venv \
    LBANN_PYTHON=/opt/lbann/view/bin/python3 \
    PYTHONNOUSERSITE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    REPRO_IMAGE=${REPRO_IMAGE} \
    REPRO_GIT_SHA=${REPRO_GIT_SHA} \
    REPRO_CONFIGS=/opt/repro/configs \
    REPRO_STAGED_DATA=/opt/repro/data
# Any uid may run it (`docker run --user`, Apptainer): /work is writable by all, like /tmp.
RUN useradd --create-home --uid 10001 --user-group repro \
    && mkdir -m 1777 /work
USER 10001:10001
WORKDIR /work
ENTRYPOINT ["repro"]
CMD ["--help"]
