# bert_reduce on NVIDIA's PyTorch container (CUDA, NCCL, PyTorch and Transformer Engine included).
#   docker build -t bert_reduce .
#   docker run --gpus all --ipc=host bert_reduce                      # python train.py
#   docker run --gpus all --ipc=host bert_reduce python train.py trainer=gpu model=esm2_8m
FROM nvcr.io/nvidia/pytorch:25.04-py3

WORKDIR /workspace/bert_reduce

# The container's torch (a 2.7 pre-release, which satisfies torch>=2.6) stays: the project installs
# on top of it, without requirements/constraints-cpu.txt (that file pins the CPU wheel), with
# what train.py imports: the recipe extra (Lightning, Hydra, ...) and hf (model=hf_esm2).
COPY pyproject.toml README.md LICENSE ./
COPY bert_reduce ./bert_reduce
RUN pip install --no-cache-dir -e ".[recipe,hf]"

COPY conf ./conf
COPY train.py ./

CMD ["python", "train.py"]
