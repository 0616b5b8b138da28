"""TRL's SFTTrainer on a few chat examples with a DeepSpeed configuration, as its users run it: a
tiny Llama with random weights and a word-level tokenizer with a chat template, built here (no hub).
The script never names zerotrain: run it with DeepSpeed 0.19.8 or with zerotrain's companion
distribution standing in for it, under torchrun on 2 ranks.

argv[1]: the spec as JSON (stage, bf16, out_dir); argv[2]: where rank 0 writes its losses."""
import json
import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import transformers as tf  # noqa: E402

WORDS = ("hello hi how are you fine thanks what is the capital of france paris two plus equals four "
         "name your my zerotrain tell me a joke no sorry good morning night bye see later").split()
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <eos> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")
CHATS = [("hello", "hi how are you"), ("how are you", "fine thanks"), ("what is the capital of france", "paris"),
         ("what is two plus two", "four"), ("what is your name", "my name is zerotrain"), ("tell me a joke", "no sorry"),
         ("good morning", "good morning"), ("good night", "bye see you later")]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = ["<pad>", "<unk>", "<bos>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {w: i for i, w in enumerate(special + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>",
                                     eos_token="<eos>")
    tok.chat_template = TEMPLATE
    return tok


def main():
    from datasets import Dataset
    from datasets.table import InMemoryTable
    from trl import SFTConfig, SFTTrainer

    spec = json.loads(sys.argv[1])
    out_dir = spec["out_dir"]
    tok = tokenizer()
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in CHATS * 4]
    # A fingerprint given: datasets 5.2 cannot hash a new table's schema with pyarrow 26 (dill fails on
    # pyarrow's MonthDayNano), with DeepSpeed as with zerotrain.
    data = Dataset(InMemoryTable.from_pylist(rows), fingerprint="zerotrain-chat-examples")
    zero = {"stage": spec["stage"]}
    if spec["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = "auto"
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "zero_optimization": zero, "bf16": {"enabled": "auto"}}
    args = SFTConfig(output_dir=out_dir, deepspeed=ds, per_device_train_batch_size=2, max_steps=6, logging_steps=1,
                     learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=2, report_to=[],
                     use_cpu=not torch.cuda.is_available(), seed=0, data_seed=0, save_strategy="no", max_length=32,
                     packing=False, dataloader_num_workers=0, disable_tqdm=True, assistant_only_loss=False,
                     bf16=spec.get("bf16", False))
    losses = {}

    class Record(tf.TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses[state.global_step] = logs["loss"]

    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok, callbacks=[Record()])
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        import deepspeed

        with open(sys.argv[2], "w") as f:
            json.dump({"losses": losses, "deepspeed": deepspeed.__version__,
                       "engine": type(trainer.model_wrapped).__module__}, f, indent=1)


if __name__ == "__main__":
    main()
