"""TRL's side of the GRPO benchmark: TRL's ``GRPOTrainer`` (plain transformers generation, no vLLM) on
the CPU, training the tiny causal LM made by ``python -m rltrain.llm.tiny DIR`` on ``reverse D:`` -> ``D``
(``ReverseDigits(length=1, seed=0)``, reward ``correct_answer``), with the settings of rltrain's own GRPO
(tests/test_grpo.py): 16 prompts x 8 completions a step, temperature 1, top_p 1, lr 3e-3 (constant),
AdamW without weight decay, one epoch per batch, no KL, token-mean loss ("dapo"), clip 0.2/0.28, rewards
scaled by the group's std, max_grad_norm 1, one torch thread, seed 0.

It measures (a) the wall seconds of each training step (generation + update: a callback's
``on_step_begin``/``on_step_end``), (b) the step and the wall time (from the first step's start) at
which the mean training reward over the last 10 steps first reaches the threshold (0.8), and the reward
curve; it writes them to a JSON file with the trl/transformers/torch versions and the GRPOConfig used.

Run it in a venv that has trl (never the main environment), nothing downloaded::

    python -m venv --system-site-packages /work/venvs/trl && /work/venvs/trl/bin/pip install trl
    python -m rltrain.llm.tiny /tmp/tiny-qwen2
    PYTHONPATH=. /work/venvs/trl/bin/python benchmarks/trl_grpo.py --model /tmp/tiny-qwen2 --steps 200 \\
        --max-new-tokens 1 --out trl_grpo.json

By default training stops at the threshold (``--no-stop`` runs all ``--steps``).

``--task tools``: episodes of several turns instead, on rltrain's ``env=tools`` (``ToolEnv``: 10 keys by default,
``--keys``), the model that ``python -m rltrain.llm.cold_start DIR`` writes, up to ``--max-turns`` turns of
``--max-new-tokens`` each. TRL plays them with a ``rollout_func`` (``tool_rollout``: ``model.generate`` per turn
over the episodes still running, the tools' tokens masked out of the loss by ``env_mask``); TRL's
``tools=``/``environment_factory=`` need a chat template that can render tool calls, which the tiny model has
not. The reward is ``correct_answer`` on the episode's last turn::

    python -m rltrain.llm.cold_start /tmp/tool-caller
    PYTHONPATH=. /work/venvs/trl/bin/python -m benchmarks.trl_grpo --model /tmp/tool-caller --task tools \
        --steps 300 --max-new-tokens 24 --lr 3e-4 --threshold 0.9 --out trl_tools.json

``--vllm``: TRL generates with vLLM (``use_vllm=True``) instead of ``model.generate``. It needs a venv with
both TRL and vLLM's CPU build; one that leaves the vLLM venv as it is (TRL 1.16 asks for vllm<=0.31 and
warns about 0.32, but runs)::

    python -m venv /work/venvs/trl-vllm
    echo /work/venvs/vllm/lib/python3.11/site-packages \
        > /work/venvs/trl-vllm/lib/python3.11/site-packages/_vllm_venv.pth
    /work/venvs/trl-vllm/bin/pip install --no-deps trl==1.16.0     # the rest is in the vLLM venv already
    /work/venvs/trl-vllm/bin/pip uninstall -y setuptools           # venv's 65.5 would shadow the vLLM venv's 78
    PYTHONPATH=. /work/venvs/trl-vllm/bin/python -m benchmarks.trl_grpo --model /tmp/tiny-qwen2 --steps 200 \
        --max-new-tokens 1 --vllm --out trl_grpo_vllm.json

``--vllm-mode colocate`` (the default) runs vLLM's ``LLM`` inside this process (TRL's
``distributed_executor_backend="external_launcher"``), which is the only mode TRL can train with on the
CPU: ``--vllm-mode server`` (``--vllm-server-url``, a server started as ``trl vllm-serve`` would start
it) stops in ``GRPOTrainer.__init__``, where TRL's ``VLLMClient.init_communicator`` refuses any device
but CUDA (its weight sync is vLLM's NCCL weight-transfer engine). For colocate this script:

- adds ``dtype="float32"`` and ``enforce_eager=True`` to TRL's ``LLM(...)``, which passes neither (vLLM
  would run the float32 model in bfloat16 on the CPU);
- sets ``VLLM_CPU_KVCACHE_SPACE`` (``--vllm-kv-cache-gb``) and ``VLLM_ENABLE_V1_MULTIPROCESSING=0``;
- keeps vLLM's linear layers' weights where TRL's weight sync can load them (``patch_vllm_cpu_gemm``:
  without it the first sync fails, ``--vllm-packed-gemm`` shows it);
- sets TRL's importance-sampling correction to rltrain's: per token, truncated at 2
  (``token_truncate``, ``vllm_importance_sampling_clip_max=2``; rltrain's ``algo.tis_cap=2``).

The JSON then holds TRL's ``sampling/*`` figures per step: ``sampling_logp_difference/max`` (vLLM's
log-prob of each sampled token against the learner's) stays near 1e-6 when vLLM has the learner's
weights. vLLM's own seed is TRL's (``process_index``: 0), not ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "offline",
           "TOKENIZERS_PARALLELISM": "false"}
PROMPTS_PER_STEP, GROUP_SIZE, WINDOW = 16, 8, 10


def reward_fn(prompts, completions, answer, reply=None, **_):
    """TRL's reward signature over rltrain's ``correct_answer``: one float per completion (an episode's: its last
    turn, ``reply``, which ``tool_rollout`` passes on)."""
    from rltrain.llm.rewards import correct_answer

    return [correct_answer(p, c, a) for p, c, a in zip(prompts, reply or completions, answer)]


def tool_rollout(env, max_new_tokens: int, max_turns: int):
    """TRL's ``rollout_func`` for ``--task tools``: the episodes of rltrain's ``ToolEnv`` (the same environment,
    tool process and rendering as ``python -m rltrain env=tools`` without a chat template), played turn by turn
    with ``model.generate`` as TRL's own generation does (sampled at temperature 1, top_p 1, top_k 0), one call
    per turn over the episodes still running, a turn ending at ``</tool>`` or eos. TRL gets each episode's tokens
    after its prompt, the model's and the tool results', and ``env_mask`` (1 for the model's: the loss trains
    those alone); ``logprobs`` None (TRL scores the tokens itself, as it does for ``model.generate``)."""

    from rltrain.llm.rollout import Conversation

    def rollout(prompts: list[str], trainer) -> dict:
        tokenizer = trainer.processing_class
        model = trainer.accelerator.unwrap_model(trainer.model)
        conversation = Conversation(tokenizer, template=False)  # the results rendered as rltrain's episodes render them
        ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        tail = [[] for _ in prompts]
        mask = [[] for _ in prompts]
        replies = [""] * len(prompts)
        live = list(range(len(prompts)))
        was_training = model.training
        model.eval()
        for _ in range(max_turns):
            if not live:
                break
            contexts = [ids[i] + tail[i] for i in live]
            width = max(map(len, contexts))
            batch = torch.tensor([[tokenizer.pad_token_id] * (width - len(c)) + c for c in contexts])
            attention = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
            with torch.no_grad():
                out = model.generate(input_ids=batch, attention_mask=attention, do_sample=True, temperature=1.0,
                                     top_p=1.0, top_k=0, max_new_tokens=max_new_tokens, stop_strings=list(env.STOP),
                                     tokenizer=tokenizer, pad_token_id=tokenizer.pad_token_id,
                                     eos_token_id=tokenizer.eos_token_id)
            still = []
            for row, i in zip(out[:, width:].tolist(), live):
                if tokenizer.eos_token_id in row:  # the turn ends with its eos; a finished row is padded after it
                    row = row[:row.index(tokenizer.eos_token_id) + 1]
                elif tokenizer.pad_token_id in row:  # ended at a stop string, then padded
                    row = row[:row.index(tokenizer.pad_token_id)]
                tail[i] += row
                mask[i] += [1] * len(row)
                replies[i] = tokenizer.decode(row, skip_special_tokens=True)
                step = env.step(None, replies[i])
                if step.done:
                    continue
                answer = conversation.answer(step.messages, row[-1:] == [tokenizer.eos_token_id])
                tail[i] += answer
                mask[i] += [0] * len(answer)
                still.append(i)
            live = still
        model.train(was_training)
        return {"prompt_ids": ids, "completion_ids": tail, "logprobs": None, "env_mask": mask, "reply": replies}

    return rollout


def vllm_options(args) -> dict:
    """GRPOConfig's vLLM keys for ``--vllm`` (none without it)."""
    if not args.vllm:
        return {}
    options = dict(use_vllm=True, vllm_mode=args.vllm_mode, vllm_model_impl="vllm",
                   vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate",
                   vllm_importance_sampling_clip_max=2.0)
    if args.vllm_mode == "colocate":
        # on the CPU vllm_gpu_memory_utilization is a share of the node's memory, checked against the free memory
        # only when VLLM_CPU_KVCACHE_SPACE is unset (main() sets it: the KV cache's size)
        options.update(vllm_gpu_memory_utilization=0.3, vllm_max_model_length=args.vllm_max_model_len,
                       vllm_enable_sleep_mode=False)
    else:
        options.update(vllm_server_base_url=args.vllm_server_url, vllm_server_timeout=args.vllm_server_timeout)
    return options


def patch_trl_llm(extra: dict) -> None:
    """TRL's colocated ``LLM(...)`` takes no dtype or enforce_eager: add them (the CPU needs float32 and eager)."""
    import trl.generation.vllm_generation as vg

    llm_class = vg.LLM

    def llm(*a, **kw):
        return llm_class(*a, **{**extra, **kw})

    vg.LLM = llm


def patch_vllm_cpu_gemm() -> None:
    """vLLM's CPU build packs each linear layer's weight for its GEMM kernel after loading and replaces the
    layer's ``weight`` with an empty Parameter that has no ``weight_loader``
    (``UnquantizedLinearMethod.process_weights_after_loading`` -> ``dispatch_cpu_unquantized_gemm(layer,
    remove_weight=True)``), so TRL's colocated weight sync (``model.load_weights([(name, param)])`` per
    parameter) fails with ``AttributeError: 'Parameter' object has no attribute 'weight_loader'``, and the
    embedding's packed copy (the tied output layer) would go stale. With this patch every such layer keeps
    its weight and multiplies with it (``torch.nn.functional.linear``): what TRL loads is what vLLM uses.
    The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the patch reaches it."""
    import vllm.model_executor.layers.utils as layer_utils

    def plain_gemm(layer, remove_weight: bool) -> None:  # both callers import it from the module at call time
        layer.cpu_linear = torch.nn.functional.linear

    layer_utils.dispatch_cpu_unquantized_gemm = plain_gemm


def grpo_config(args, output_dir: str):
    """The GRPOConfig matching rltrain's GRPO settings (see the module docstring)."""
    from trl import GRPOConfig

    micro = args.micro_batch_size
    if (PROMPTS_PER_STEP * GROUP_SIZE) % micro:
        raise SystemExit(f"--micro-batch-size must divide {PROMPTS_PER_STEP * GROUP_SIZE}")
    return GRPOConfig(
        output_dir=output_dir,
        # one optimizer step = one generation batch of 16 prompts x 8 completions, in micro-batches
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=PROMPTS_PER_STEP * GROUP_SIZE // micro,
        num_generations=GROUP_SIZE,
        max_completion_length=args.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch", weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        max_grad_norm=1.0,
        num_iterations=1, beta=0.0, epsilon=0.2, epsilon_high=0.28,
        loss_type="dapo", scale_rewards="group", mask_truncated_completions=False,
        max_steps=args.steps, seed=args.seed, data_seed=args.seed,
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False,
        **vllm_options(args),
    )


def make_callback(threshold: float, stop: bool):
    from transformers import TrainerCallback

    class Timing(TrainerCallback):
        """Per-step wall seconds (begin to end of each optimizer step), the logged mean reward of each
        step, and the first step whose last-``WINDOW`` mean reward reaches ``threshold``."""

        def __init__(self):
            self.start = None
            self.begin = None
            self.seconds: list[float] = []
            self.rewards: list[float] = []
            self.sampling: list[dict] = []  # with vLLM: TRL's sampler-vs-learner log-prob figures, per step
            self.reached = None  # {"step", "wall_s"}
            self.threads = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.threads = torch.get_num_threads()

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()
            if self.start is None:
                self.start = self.begin

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.begin)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:
                return
            self.rewards.append(float(logs["reward"]))
            sampling = {k: float(v) for k, v in logs.items() if k.startswith("sampling/")}
            if sampling:
                self.sampling.append(sampling)
            recent = self.rewards[-WINDOW:]
            if self.reached is None and len(recent) == WINDOW and sum(recent) / WINDOW >= threshold:
                self.reached = {"step": len(self.rewards), "wall_s": time.perf_counter() - self.start}
                if stop:
                    control.should_training_stop = True

    return Timing()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the tiny model dir (python -m rltrain.llm.tiny DIR)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--micro-batch-size", type=int, default=64, help="rltrain's test uses 64 (2 micro-batches)")
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--no-stop", action="store_true", help="run all --steps even after the threshold")
    parser.add_argument("--seed", type=int, default=0, help="the trainer's seed (model init is the model dir's)")
    parser.add_argument("--task-seed", type=int, default=0, help="ReverseDigits' seed (the rows)")
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--task", choices=["reverse", "tools"], default="reverse",
                        help="tools: episodes of rltrain's ToolEnv through TRL's rollout_func (see tool_rollout)")
    parser.add_argument("--keys", type=int, default=10, help="--task tools: env.keys")
    parser.add_argument("--max-turns", type=int, default=2, help="--task tools: the model's turns per episode")
    parser.add_argument("--vllm", action="store_true", help="generate with vLLM (use_vllm=True)")
    parser.add_argument("--vllm-mode", choices=["colocate", "server"], default="colocate")
    parser.add_argument("--vllm-server-url", default="http://127.0.0.1:8000", help="--vllm-mode server: the server's")
    parser.add_argument("--vllm-server-timeout", type=float, default=240.0)
    parser.add_argument("--vllm-kv-cache-gb", type=float, default=1.0, help="VLLM_CPU_KVCACHE_SPACE (colocate)")
    parser.add_argument("--vllm-max-model-len", type=int, default=256, help="the tiny model's context")
    parser.add_argument("--vllm-packed-gemm", action="store_true",
                        help="keep vLLM's packed CPU GEMM (TRL's weight sync then fails: patch_vllm_cpu_gemm)")
    args = parser.parse_args(argv)

    for key, value in OFFLINE.items():  # before transformers is imported: nothing is downloaded
        os.environ.setdefault(key, value)
    if args.vllm and args.vllm_mode == "colocate":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{args.vllm_kv_cache_gb:g}")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    torch.set_num_threads(1)
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, set_seed
    from trl import GRPOTrainer

    from rltrain.llm.environments import ToolEnv
    from rltrain.llm.tasks import ReverseDigits

    if args.vllm and args.vllm_mode == "colocate":
        patch_trl_llm({"dtype": "float32", "enforce_eager": True})
        if not args.vllm_packed_gemm:
            patch_vllm_cpu_gemm()

    set_seed(args.seed)
    env = ToolEnv(keys=args.keys, seed=args.task_seed) if args.task == "tools" else None
    task = env or ReverseDigits(length=1, seed=args.task_seed)
    rows = task.take(args.steps * PROMPTS_PER_STEP)
    dataset = datasets.Dataset.from_list(rows)
    episodes = {} if env is None else {"rollout_func": tool_rollout(env, args.max_new_tokens, args.max_turns)}
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    callback = make_callback(args.threshold, stop=not args.no_stop)
    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as out_dir:
        config = grpo_config(args, out_dir)
        trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[callback], **episodes)
        trainer.remove_callback(PrinterCallback)  # its per-step log dicts: the JSON has what we need
        wall = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - wall
        config_dict = {k: v for k, v in config.to_dict().items() if k != "output_dir"}
    if env is not None:
        env.close()

    seconds = callback.seconds
    result = {
        "what": "TRL GRPOTrainer on the tiny Qwen2 model, "
                + ("env=tools episodes (rollout_func)" if env else "reverse D: -> D") + ", CPU, 1 torch thread"
                + (f", vLLM generating ({args.vllm_mode})" if args.vllm else ""),
        "command": " ".join([Path(sys.executable).as_posix(), *sys.argv]),
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                     "datasets": datasets.__version__, "python": platform.python_version(),
                     **({"vllm": __import__("vllm").__version__} if args.vllm else {})},
        "torch_threads_at_train_begin": callback.threads,
        "max_new_tokens": args.max_new_tokens, "seed": args.seed, "task_seed": args.task_seed, "task": args.task,
        **({"keys": args.keys, "max_turns": args.max_turns} if env else {}),
        "prompts_per_step": PROMPTS_PER_STEP, "group_size": GROUP_SIZE,
        "steps_run": len(seconds),
        "step_seconds": seconds,
        "step_seconds_median": statistics.median(seconds) if seconds else None,
        "step_seconds_median_after_first": statistics.median(seconds[1:]) if len(seconds) > 1 else None,
        "completions_per_s_median_step": (PROMPTS_PER_STEP * GROUP_SIZE / statistics.median(seconds)
                                          if seconds else None),
        "completions_per_s": PROMPTS_PER_STEP * GROUP_SIZE * len(seconds) / sum(seconds) if seconds else None,
        "step_rewards": callback.rewards,
        "step_sampling": callback.sampling,
        "threshold": args.threshold, "window": WINDOW,
        "threshold_step": callback.reached and callback.reached["step"],
        "threshold_wall_s": callback.reached and callback.reached["wall_s"],
        "train_wall_s": wall,
        "steps_wall_s": sum(seconds),
        "grpo_config": json.loads(json.dumps(config_dict, default=str)),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("versions", "steps_run", "step_seconds_median", "completions_per_s",
                                             "threshold_step", "threshold_wall_s", "train_wall_s")}))


if __name__ == "__main__":
    main()
