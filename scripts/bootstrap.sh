#!/usr/bin/env bash
# Creates .venv and installs echo2 with its test and speed extras, CPU torch first.
# torch==2.13.0 first: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
python -m pip install -q torch==2.13.0 2>&1 | grep -v "is ignored" || true
python -m pip install -q -e '.[dev,fast,hf,data,verify,tensorboard,wandb,lora]' 2>&1 | grep -v "is ignored" || true
python -c "import echo2, torch, zmq, msgspec; print('echo2 ready: torch', torch.__version__, 'pyzmq', zmq.__version__)"
