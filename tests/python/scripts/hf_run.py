"""Run under `zerotrain launch --nproc 2`: a tiny Hugging Face transformers model (random weights,
no hub) trained through zerotrain's Python front end with the settings in argv; rank 0 writes its
losses and the engine's stage-3 counters as JSON."""
import json
import sys
import warnings

import torch

import zerotrain

warnings.filterwarnings("ignore")


def build(kind):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "llama":
        cfg = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=False)
        return tf.LlamaForCausalLM(cfg)
    if kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
        return tf.GPT2LMHeadModel(cfg)
    if kind == "deep_init":
        return deep_init_model(tf)
    if kind == "bert":
        cfg = tf.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
        return tf.BertForPreTraining(cfg)
    raise ValueError(kind)


def deep_init_model(tf):
    """A transformers model whose _init_weights, called on the model itself, writes into a
    grandchild's parameters (what a model with nested blocks may do) as well as its children's."""

    class DeepInitConfig(tf.PretrainedConfig):
        model_type = "zerotrain-deep-init"

    class Output:
        def __init__(self, loss):
            self.loss = loss

    class DeepInit(tf.PreTrainedModel):
        config_class = DeepInitConfig

        def __init__(self, config):
            super().__init__(config)
            self.embed = torch.nn.Embedding(96, 16)
            self.body = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU()),
                                            torch.nn.Linear(32, 16))
            self.head = torch.nn.Linear(16, 96)
            # A parameter of its own: transformers skips _init_weights on a custom model's module that
            # has none.
            self.scale = torch.nn.Parameter(torch.empty(16))
            self.post_init()

        def _init_weights(self, module):
            if module is self:
                torch.nn.init.ones_(self.scale)
                torch.nn.init.normal_(self.embed.weight, std=0.5)
                torch.nn.init.normal_(self.body[0][0].weight, std=0.3)  # a grandchild
                torch.nn.init.uniform_(self.body[0][0].bias, -0.1, 0.1)
                torch.nn.init.normal_(self.body[1].weight, std=0.2)
            elif isinstance(module, torch.nn.Linear) and module is self.head:
                torch.nn.init.normal_(module.weight, std=0.1)

        def forward(self, input_ids, labels):
            logits = self.head(self.body(self.embed(input_ids) * self.scale))
            return Output(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))

    torch.manual_seed(0)
    return DeepInit(DeepInitConfig())


def loss_of(kind, engine, ids):
    if kind == "bert":
        out = engine(input_ids=ids, labels=ids, next_sentence_label=torch.zeros(ids.shape[0], dtype=torch.long))
    else:
        out = engine(input_ids=ids, labels=ids)
    return out.loss


def build_under_init(kind, config):
    """The model built under zerotrain.zero.Init, and the names of the parameters whose values differ
    from those of the same model built without it (same seed): its own initialisation must apply."""
    reference = build(kind)
    with zerotrain.zero.Init(config_dict_or_path=config):
        model = build(kind)
    sharded = [n for n, p in model.named_parameters() if p.numel() > 0 and p.untyped_storage().nbytes() == 0]
    differ = []
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        with zerotrain.zero.GatheredParameters([p]):
            if not torch.equal(p.detach(), q.detach()):
                differ.append(name)
    return model, {"sharded": len(sharded), "differ": differ}


def main():
    spec = json.loads(sys.argv[1])
    kind = spec["model"]
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              "zero_optimization": dict({"stage": spec["stage"], "stage3_param_persistence_threshold": 0},
                                        **spec.get("zero", {}))}
    init = None
    if spec.get("zero_init"):
        model, init = build_under_init(kind, config)
    else:
        model = build(kind)
    if spec.get("checkpointing"):
        model._set_gradient_checkpointing(True, zerotrain.checkpointing.checkpoint)
        model.train()
    engine, _, _, _ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank = zerotrain.comm.get_rank()
    g = torch.Generator().manual_seed(10 + rank)
    losses = []
    for step in range(3):
        ids = torch.randint(0, 96, (2, 16), generator=g)
        loss = loss_of(kind, engine, ids)
        engine.backward(loss)
        engine.step()
        mean = torch.tensor([float(loss)])
        zerotrain.comm.all_reduce(mean)
        losses.append(float(mean) / zerotrain.comm.get_world_size())
    if spec.get("save"):
        # A checkpoint in the command line's format, and what the trained model computes on a fixed
        # batch, for the test to compare with transformers loading the export.
        engine.save_checkpoint(spec["save"], tag="final")
        engine.eval()
        with torch.no_grad():
            ids = torch.arange(16).reshape(1, 16) % 96
            logits = engine(input_ids=ids).logits
        if rank == 0:
            model.config.to_json_file(spec["save"] + "/config.json")
            torch.save(logits, spec["save"] + "/logits.pt")
    if rank == 0:
        with open(sys.argv[2], "w") as f:
            json.dump({"losses": losses, "init": init, "peak_gathered_bytes": engine._engine.diagnostics()["peak_gathered_parameter_bytes"],
                       "trainable_bytes": 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)}, f)


if __name__ == "__main__":
    main()
