"""The transformers Trainer on the CPU: a tiny GPT-2 in float16 with too high a learning rate overflows.

The model is built from a small `GPT2Config` with random weights (nothing is downloaded) and cast to float16 with
`.half()`: the Trainer's `fp16=True` needs a GPU, and pure-fp16 weights overflow just the same. Plain SGD at a
learning rate of 20 makes the weights grow with every optimizer step until the output of a block's MLP projection
(`transformer.h.1.mlp.c_proj`) passes 65504, the largest float16, and turns to inf. `OverflowTrainerCallback` shows
the frames that led there and stops the run before the optimizer step that would apply that micro-batch. Gradient
accumulation is 2: `batch_number` counts micro-batches, the report also gives the optimizer step
(`state.global_step`) and the epoch.

    python examples/hf_trainer.py [--config nanwatch.yaml] [--report-dir reports/] [--max-frames-to-save 21]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from nanwatch import NonFiniteError
from nanwatch.adapters.hf_trainer import OverflowTrainerCallback
from nanwatch.cli.options import add_config_arguments, config_from_args

VOCAB = 128
SEQUENCE = 16


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token sequences for causal language modelling (the labels are the inputs)."""

    def __init__(self, count: int = 256) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (count, SEQUENCE), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=20.0, help="learning rate (default: 20, far too high)")
    parser.add_argument("--max-steps", type=int, default=50, help="most optimizer steps (default: 50)")
    add_config_arguments(parser, defaults={"max_frames_to_save": 12})
    args = parser.parse_args(argv)
    config = config_from_args(args, parser)

    torch.manual_seed(0)
    model_config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQUENCE, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(model_config).half()
    model.loss_type = "ForCausalLM"

    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            max_steps=args.max_steps,
            optim="sgd",
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            max_grad_norm=0.0,  # no clipping: let the weights run away
            logging_steps=1,
            logging_nan_inf_filter=False,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model,
            args=training_args,
            train_dataset=RandomTokens(),
            callbacks=[OverflowTrainerCallback(config)],
        )
        try:
            trainer.train()
        except NonFiniteError as error:
            finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
            print(
                f"stopped: inf/nan in batch_number={error.batch_number} (epoch {error.epoch}), first in module "
                f"{error.module_name!r}; optimizer step {error.optimizer_step} never ran; weights still finite: "
                f"{finite}"
            )
            return 1
    print("finished without inf/nan")
    return 0


if __name__ == "__main__":
    sys.exit(main())
