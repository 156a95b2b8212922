"""The reference log-probabilities of full-weight preference tuning: the model as loaded scores every pair once,
before its first update, and the scores are kept beside the tokenised pairs.

Training every weight leaves no frozen base to switch back to (as LoRA's disabled adapters are), and a second,
frozen copy would cost another model's memory on every GPU. One pass over the pairs instead costs one forward
a pair, once: the scores are saved in the data cache, keyed by the tokenised pairs, the model's files and the
precision, so a rerun and a resume (whose model has already moved) read them instead of recomputing them.

Online training (grpo_full.py --beta) scores new completions at every batch, so it keeps the weights as loaded
instead (`StartingWeights`): each process's own share of them, swapped in for the reference's forward.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ..data.batches import WithTargetPositions
from ..launching.launch import FSDP
from ..model.model_config import weight_files


def indexed(pairs):
    """`pairs` with a `pair_index` column: where each pair's reference scores are in the table."""
    return pairs.add_column("pair_index", np.arange(len(pairs), dtype=np.int64))


def reference_logps(accelerator, model, pairs, collate, batch_size: int, sequence_logps, key: str,
                    unit: str = "pairs") -> torch.Tensor:
    """(pairs x 2) float32 on the CPU: each pair's chosen and rejected log-probabilities under `model` as it is
    now (`sequence_logps(model, batch)`: the recipe's own), read from the cache where an earlier run wrote them
    under `key` (reference_key). `pairs` are `indexed` (KTO's: a row and its mismatched row, `unit` "rows").
    Every rank takes part (sharded forwards are collective), so the ranks read the cache only when every one of
    them has it (machines may each keep their own)."""
    cache = cache_file(pairs, key)
    scores = read_cache(cache, len(pairs))
    everyone_has_it = bool(accelerator.gather(torch.tensor([int(scores is not None)], device=accelerator.device)).all())
    if everyone_has_it:
        if accelerator.is_main_process:
            print(f"reference: {len(pairs):,} {unit}' scores read from {cache} (the model as loaded scored "
                  "them in an earlier run)", flush=True)
        return torch.from_numpy(scores).float()
    # every pair once, in order: the training loader's shuffle drops a ragged tail
    loader = accelerator.prepare_data_loader(DataLoader(pairs, batch_size=batch_size, shuffle=False,
                                                    collate_fn=WithTargetPositions(collate)))
    scores = np.zeros((len(pairs), 2), dtype=np.float64)
    was_training = model.training
    model.eval()  # no dropout: the reference is the model itself, not a noisy draw of it
    with torch.no_grad():
        for batch in tqdm(loader, desc="reference log-probabilities", disable=not accelerator.is_main_process or None):
            chosen, rejected = sequence_logps(model, batch)[0].double().chunk(2)
            # gather_for_metrics drops the pairs accelerate repeated to even out the last batch
            index, chosen, rejected = accelerator.gather_for_metrics((batch["pair_index"].to(chosen.device), chosen,
                                                                      rejected))
            scores[index.cpu().numpy()] = torch.stack([chosen, rejected], 1).cpu().numpy()
    model.train(was_training)
    if cache is not None and accelerator.is_local_main_process:  # each machine's own data cache
        partial = cache.with_suffix(f".partial-{accelerator.process_index}.npy")
        np.save(partial, scores)
        partial.replace(cache)  # whole or absent: a crash never leaves part of the scores to be read as all
    if accelerator.is_main_process:
        kept = f"; kept in {cache}" if cache is not None else ""
        print(f"reference: {len(pairs):,} {unit} scored by the model as loaded, before training{kept}", flush=True)
    return torch.from_numpy(scores).float()


def of_batch(scores: torch.Tensor, batch: dict) -> torch.Tensor:
    """The reference log-probabilities of a micro-batch's rows (its chosen sides, then its rejected sides)."""
    rows = scores[batch["pair_index"].cpu()]
    return torch.cat([rows[:, 0], rows[:, 1]]).to(batch["input_ids"].device)


def read_cache(cache: Path | None, pairs: int) -> np.ndarray | None:
    """The cached scores of `pairs` pairs, or None where this process finds none (or a file of another shape)."""
    if cache is None or not cache.exists():
        return None
    scores = np.load(cache)
    return scores if scores.shape == (pairs, 2) else None


def cache_file(pairs, key: str) -> Path | None:
    """Beside the tokenised pairs' own cache file (None when they have none: rows made in memory)."""
    if not pairs.cache_files:
        return None
    name = hashlib.sha256(f"{pairs._fingerprint}:{key}".encode()).hexdigest()[:20]
    return Path(pairs.cache_files[0]["filename"]).parent / f"reference-logps-{name}.npy"


def reference_key(model_name: str, precision: str, max_length: int) -> str:
    """What the scores depend on besides the pairs: the model's weight files (path, size, time: a model saved
    again at the same path is another model) and how it computes (precision; --max-length cuts the sides)."""
    files = sorted(set((weight_files(model_name) or {}).values()))
    stats = [(file, Path(file).stat().st_size, Path(file).stat().st_mtime_ns) for file in files]
    return json.dumps({"model": model_name, "files": stats, "precision": precision, "max_length": max_length})


class StartingWeights:
    """The weights as loaded, kept beside the trained ones as each process holds them after `accelerator.prepare`
    (and before a resume loads trained ones): under FSDP2 and ZeRO-3 its shard, one more copy of a process's
    share of the weights rather than a second model to load, place and shard. `swapped_in` makes the model
    compute as it was loaded for the duration (the reference of grpo_full.py's KL term).

    What a forward reads, per strategy: the parameters themselves (one process, DDP, model parallel, ZeRO-1/2's
    16-bit copies); FSDP2's local shards and ZeRO-3's partitions (`ds_tensor`), gathered at each forward. The
    weights gathered whole (those FSDP2 or ZeRO-3 keep between forwards too) are released before and after the
    swap, so that no forward reads stale ones."""

    def __init__(self, model, launch):
        self.model, self.launch = model, launch
        with torch.no_grad():
            self.release_gathered()
            self.kept = [tensor.clone() for tensor in self.read_by_forward()]

    def read_by_forward(self) -> list[torch.Tensor]:
        """The tensors a forward reads the weights from (with every gathered weight released)."""
        tensors = []
        for parameter in self.model.parameters():
            if self.launch.kind == FSDP and hasattr(parameter, "to_local"):
                tensors.append(parameter.to_local())  # (a view of FSDP2's shard storage)
            elif hasattr(parameter, "ds_tensor"):
                tensors.append(parameter.ds_tensor)
            else:
                tensors.append(parameter.data)
        return tensors

    def release_gathered(self) -> None:
        """FSDP2's modules resharded, ZeRO-3's gathered parameters partitioned again (a forward gathers them)."""
        if self.launch.kind == FSDP:
            from torch.distributed.fsdp import FSDPModule

            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        elif self.launch.zero_stage == 3:
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

            # every gathered one, those it keeps gathered (`ds_persist`) too, as DeepSpeed does around a checkpoint
            gathered = [p for p in self.model.parameters() if p.ds_status == ZeroParamStatus.AVAILABLE]
            if gathered:
                gathered[0].partition(gathered)

    @contextmanager
    def swapped_in(self):
        """The model computes with the weights as loaded while this lasts; its trained weights come back after."""
        with torch.no_grad():
            self.release_gathered()
            self.swap()
            try:
                yield
            finally:
                self.release_gathered()
                self.swap()

    def swap(self) -> None:
        for current, kept in zip(self.read_by_forward(), self.kept, strict=True):
            trained = current.clone()  # one tensor at a time: no second copy of the whole model
            current.copy_(kept)
            kept.copy_(trained)
