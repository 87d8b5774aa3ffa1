"""TRL's GRPOTrainer on the same model, prompts, reward and batch as a tidal RL run: the peer
side of benchmarks/rl_peer.py (which writes its inputs and reads its JSON).

Inputs: `--hf DIR`, the tidal SFT warm start exported as a Hugging Face folder (weights,
tokenizer.json); `--problems FILE`, a JSON of the run: the task (name, params), the rendered
prompts of every step (the same problems tidal's generator 0 draws at that step), their token
ids as tidal encodes them, the held-out eval set, the stop token ids and the loop's settings
(group size, new tokens, learning rate, warm-up, temperature).

TRL runs with its own defaults elsewhere: its transformers generation (no vLLM), the "dapo"
loss, no KL term. The model is loaded in bf16 (as in ../shared/anchors/trl_grpo.py, where TRL
measured 3.39 s per step at this batch on a random-init model). Every `eval_every` steps a
callback scores greedy pass@1 on the held-out set with `model.generate`; that time is kept out
of the step times. Needs trl and datasets (carried as wheels to the GPU machine):

    python benchmarks/rl_trl.py --hf DIR --problems FILE --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf", required=True, help="the exported Hugging Face folder")
    p.add_argument("--problems", required=True, help="the run's JSON (benchmarks/rl_peer.py)")
    p.add_argument("--json", required=True, help="write the figures here")
    p.add_argument("--output-dir", default="/tmp/tidal_trl_out")
    args = p.parse_args()

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tidal.rl.tasks import get_task

    run = json.loads(open(args.problems).read())
    task = get_task(run["task"], **run["task_params"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(args.hf, "tokenizer.json"))
    stop = run["stop_ids"]
    tok.eos_token = tok.convert_ids_to_tokens(stop[-1])
    tok.pad_token = tok.eos_token
    # The prompts must reach the model as the same ids tidal's generator feeds it.
    mismatched = sum(
        tok(text, add_special_tokens=False)["input_ids"] != ids
        for text, ids in zip(run["train_text"], run["train_ids"], strict=True)
    )
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.hf, dtype=dtype).to(device)
    model.generation_config.eos_token_id = stop
    model.generation_config.pad_token_id = tok.pad_token_id

    def reward(completions, reference, **_):
        return [
            task.grade(text, ref).reward for text, ref in zip(completions, reference, strict=True)
        ]

    refs = run["train_refs"]
    data = Dataset.from_list(
        [{"prompt": t, "reference": r} for t, r in zip(run["train_text"], refs, strict=True)]
    )
    P, G, N, steps = run["prompts_per_step"], run["group_size"], run["max_new_tokens"], run["steps"]
    cfg = GRPOConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=P * G,
        num_generations=G,
        max_completion_length=N,
        learning_rate=run["lr"],
        warmup_steps=run["warmup_steps"],
        lr_scheduler_type="cosine",
        logging_steps=1,
        max_steps=steps,
        bf16=device == "cuda",
        report_to="none",
        save_strategy="no",
        use_vllm=False,
        gradient_accumulation_steps=1,
        shuffle_dataset=False,
        temperature=run["temperature"],
        seed=0,
    )
    eval_text = run["eval_text"]

    @torch.no_grad()
    def evaluate() -> tuple[float, float]:
        t0 = time.perf_counter()
        model.eval()
        correct, tok.padding_side = 0, "left"
        for lo in range(0, len(eval_text), 128):
            part = eval_text[lo : lo + 128]
            enc = tok(part, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            out = model.generate(**enc, max_new_tokens=N, do_sample=False)
            texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            for text, ref in zip(texts, run["eval_refs"][lo : lo + 128], strict=True):
                correct += task.grade(text, ref).reward >= 1.0
        model.train()
        return correct / max(len(eval_text), 1), time.perf_counter() - t0

    steps_out: list[dict] = []
    evals: list[dict] = []
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    class Clock(TrainerCallback):
        def on_step_begin(self, a, s, c, **k):
            sync()
            self.t = time.perf_counter()

        def on_step_end(self, a, s, c, **k):
            sync()
            steps_out.append({"step": s.global_step, "step_s": time.perf_counter() - self.t})
            last = s.global_step == steps
            if last or (run["eval_every"] and s.global_step % run["eval_every"] == 0):
                pass1, secs = evaluate()
                evals.append({"step": s.global_step, "eval_pass1": pass1, "eval_s": secs})
                print(f"trl eval step {s.global_step}: pass@1 {100 * pass1:.1f}% ({secs:.0f}s)")

        def on_log(self, a, s, c, logs=None, **k):
            if logs and "reward" in logs and steps_out:
                steps_out[-1]["reward_mean"] = logs["reward"]
                steps_out[-1]["response_len_mean"] = logs.get("completions/mean_length")

    pass1, secs = evaluate()
    evals.append({"step": 0, "eval_pass1": pass1, "eval_s": secs})
    print(f"trl eval step 0: pass@1 {100 * pass1:.1f}% ({secs:.0f}s)")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=cfg,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Clock()],
    )
    trainer.train()
    result = {
        "steps": steps_out,
        "evals": evals,
        "prompt_id_mismatches": mismatched,
        "params": sum(p.numel() for p in model.parameters()),
    }
    with open(args.json, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
