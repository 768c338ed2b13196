"""A trainer written only to vllm-ascend's static trainer API: `python upstream_style_trainer.py SPEC_JSON`.

It imports torch and ``HCCLWeightTransferEngine`` / ``HCCLTrainerSendWeightsArgs`` from our
``static_trainer`` module and nothing else of ours: the calls below are upstream's
(``vllm_ascend/distributed/weight_transfer/hccl_engine.py``), only the import line differs. For
each round it prints ``ROUND <json>`` with what it sent (SHA-256 of each tensor's bytes, dtype and
shape) or the error it got.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from ascend_dist.weight_transfer.static_trainer import HCCLTrainerSendWeightsArgs, HCCLWeightTransferEngine


class Model(torch.nn.Module):
    """Parameters named, typed and shaped as the spec says (flat names: one module level)."""

    def __init__(self, specs: list[list]) -> None:
        super().__init__()
        for name, dtype, shape in specs:
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape, dtype=getattr(torch, dtype)),
                                                             requires_grad=False))  # fmt: skip

    def randomize(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                raw = torch.randint(0, 256, (p.numel() * p.element_size(),), dtype=torch.uint8, generator=gen)
                p.copy_(raw.view(p.dtype).reshape(p.shape))


def digests(pairs: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    out = {}
    for name, t in pairs:
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        tag = str(t.dtype).removeprefix("torch.").encode() + repr(tuple(t.shape)).encode()
        out[name] = hashlib.sha256(data + tag).hexdigest()
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    model = Model(spec["specs"])
    group = HCCLWeightTransferEngine.trainer_init(
        dict(master_address="127.0.0.1", master_port=spec["port"], world_size=spec["world_size"])
    )
    first = spec["specs"][0][0]
    for seed, mode in spec["rounds"]:
        model.randomize(seed)
        sent = [(n, p.detach().clone()) for n, p in model.named_parameters()]
        try:
            if mode == "dict":  # upstream's dict form, packing given per send as upstream frameworks do
                args = dict(group=group, packed=True, packed_buffer_size_bytes=spec["buffer"], packed_num_buffers=2)
                HCCLWeightTransferEngine.trainer_send_weights(model.named_parameters(), args)
            elif mode == "dataclass":  # the dataclass form with a post_iter_func (here: zero the first tensor)
                sent[0] = (first, torch.zeros_like(sent[0][1]))
                post = lambda item: torch.zeros_like(item[1]) if item[0] == first else item[1]  # noqa: E731
                HCCLWeightTransferEngine.trainer_send_weights(
                    iter(model.named_parameters()),
                    HCCLTrainerSendWeightsArgs(group=group, post_iter_func=post, packed=True,
                                               packed_buffer_size_bytes=spec["buffer"], packed_num_buffers=2),
                )  # fmt: skip
            else:  # upstream's default (unpacked) against workers initialised packed: refused, typed
                HCCLWeightTransferEngine.trainer_send_weights(model.named_parameters(), dict(group=group, packed=False))
            print("ROUND " + json.dumps({"ok": True, "digests": digests(sent)}), flush=True)
        except Exception as exc:  # reported to the test, which expects it for the mismatched round
            print("ROUND " + json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
    group.shutdown()


if __name__ == "__main__":
    main()
