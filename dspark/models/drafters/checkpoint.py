"""Drafter checkpoints: load the DeepSpec DSpark and z-lab DFlash layouts, save DSpark's."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspark.models.drafters.dspark import BlockDrafter, DrafterConfig
from dspark.models.llama import LlamaConfig


def check_fits(dc: DrafterConfig, tc: LlamaConfig, fc_in: int) -> None:
    """Refuse a drafter built for another target, naming the mismatch."""
    problems = []
    if dc.vocab_size != tc.vocab_size:
        problems.append(f"vocab {dc.vocab_size} != target vocab {tc.vocab_size}")
    if fc_in != len(dc.target_layer_ids) * tc.hidden_size:
        problems.append(f"fc expects {fc_in} features but {len(dc.target_layer_ids)} target layers of "
                        f"hidden size {tc.hidden_size} give {len(dc.target_layer_ids) * tc.hidden_size}")
    bad = [i for i in dc.target_layer_ids if not 0 <= i < tc.num_hidden_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} outside the target's {tc.num_hidden_layers} layers")
    if dc.num_target_layers not in (None, tc.num_hidden_layers):
        problems.append(f"trained for a {dc.num_target_layers}-layer target, this one has {tc.num_hidden_layers}")
    if not 0 <= dc.mask_token_id < tc.vocab_size:
        problems.append(f"mask_token_id {dc.mask_token_id} outside the vocabulary")
    if problems:
        raise ValueError("drafter does not fit the target model: " + "; ".join(problems))


def _to_module_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names -> the shared layers' fused q/k/v and gate/up projections."""
    out = {k.removeprefix("model."): v for k, v in sd.items()}
    for key in [k for k in out if k.endswith("mlp.gate_proj.weight")]:
        pre = key.removesuffix("gate_proj.weight")
        out[pre + "gate_up_proj.weight"] = torch.cat([out.pop(key), out.pop(pre + "up_proj.weight")])
    for key in [k for k in out if k.endswith("self_attn.q_proj.weight")]:
        pre = key.removesuffix("q_proj.weight")
        if all(pre + f"{x}_proj.weight" in out for x in "kv"):
            out[pre + "qkv_proj.weight"] = torch.cat([out.pop(pre + f"{x}_proj.weight") for x in "qkv"])
    return out


def read_drafter_folder(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, every *.safetensors tensor under its checkpoint name) of a drafter folder."""
    path = Path(path)
    cfg_file = path / "config.json"
    files = sorted(path.glob("*.safetensors"))
    if not cfg_file.is_file() or not files:
        raise ValueError(f"drafter folder {path} needs config.json and model.safetensors")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            sd.update(load_file(str(f)))
        except Exception as e:  # safetensors' own error type: a truncated or foreign file
            raise ValueError(f"cannot read {f}: {e}") from None
    return json.loads(cfg_file.read_text()), sd


def load_drafter(path: str | Path, target, dtype: torch.dtype, device: str | torch.device) -> BlockDrafter:
    """Load a drafter folder (config.json + *.safetensors) and attach it to the target model."""
    path = Path(path)
    cfg, sd = read_drafter_folder(path)
    dc = DrafterConfig.from_hf(cfg)
    sd = _to_module_names(sd)
    if "fc.weight" not in sd:
        raise ValueError(f"{path} is not a DSpark/DFlash drafter (no fc.weight)")
    check_fits(dc, target.config, sd["fc.weight"].shape[1])
    if dc.hidden_size != target.config.hidden_size and ("embed_tokens.weight" not in sd or "lm_head.weight" not in sd):
        raise ValueError(f"drafter hidden size {dc.hidden_size} differs from the target's "
                         f"{target.config.hidden_size} and it has no embed_tokens/lm_head of its own")
    model = BlockDrafter(dc, target.config.hidden_size, own_embed="embed_tokens.weight" in sd,
                         own_head="lm_head.weight" in sd)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"drafter checkpoint {path} does not match its config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    d2t, V = model.draft_to_target, target.config.vocab_size
    if d2t is not None and (d2t.min() < 0 or d2t.max() >= V or d2t.unique().numel() != d2t.numel()):
        raise ValueError(f"drafter checkpoint {path}: draft_to_target must hold {dc.draft_vocab_size} distinct "
                         f"token ids below {V}")
    model.attach(target)
    return model.to(device, dtype).eval()



def drafter_state_dict(model: BlockDrafter) -> dict[str, torch.Tensor]:
    """State dict in the DSpark layout (separate gate/up), without shared target weights."""
    out = {}
    c = model.config
    split = [c.num_attention_heads * c.head_dim] + [c.num_key_value_heads * c.head_dim] * 2
    for k, v in model.state_dict().items():
        if k.endswith("mlp.gate_up_proj.weight"):
            gate, up = v.chunk(2)
            pre = k.removesuffix("gate_up_proj.weight")
            out[pre + "gate_proj.weight"], out[pre + "up_proj.weight"] = gate, up
        elif k.endswith("self_attn.qkv_proj.weight"):
            pre = k.removesuffix("qkv_proj.weight")
            for x, part in zip("qkv", v.split(split)):
                out[pre + f"{x}_proj.weight"] = part
        else:
            out[k] = v
    return {k: v.detach().contiguous().cpu() for k, v in out.items()}


def save_drafter(model: BlockDrafter, path: str | Path, dtype: torch.dtype = torch.float32) -> None:
    """Write config.json + model.safetensors in the DSpark layout."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in drafter_state_dict(model).items()}
    save_file(sd, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2) + "\n")
