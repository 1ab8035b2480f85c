"""What an extraction did, as numbers and as the lines the CLI prints."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ExtractSummary:
    dataset_id: str
    samples: int
    tokens: int
    loss_tokens: int
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    truncated: int = 0
    dropped_leading_assistant: int = 0
    shards: int = 0
    shards_resumed: int = 0  # committed by an earlier, interrupted run and kept
    forward_tokens: int = 0  # tokens forwarded in this run
    forward_seconds: float = 0.0  # wall time of the forward stage in this run
    seconds: float = 0.0
    store_bytes: int = 0
    head_bytes: int = 0  # embedding + LM head: a fixed cost, left out of bytes/token
    actors: int = 0  # forward actors that committed shards in this run
    nodes: int = 0  # Ray nodes whose actors committed shards in this run
    actor_seconds: float = 0.0  # busy time of the actors, summed over shards (forward + write)
    actor_forward_seconds: float = 0.0  # of which the forward alone
    write_overlap_seconds: float = 0.0  # shard writes that ran while the same actor forwarded the next shard
    actor_busy_seconds: float = 0.0  # per actor, first forward to last commit, summed over actors
    driver_peak_rss_mib: float = 0.0  # the driver process's peak resident memory (bounded: inputs are streamed)
    state: str = "new"  # new | resume | complete (nothing left to do)
    dry_run: bool = False

    @property
    def rejected(self) -> int:
        return sum(self.rejected_by_reason.values())

    @property
    def tokens_per_second(self) -> float:
        return self.forward_tokens / self.forward_seconds if self.forward_seconds > 0 else 0.0

    @property
    def bytes_per_token(self) -> float:
        return (self.store_bytes - self.head_bytes) / self.tokens if self.tokens else 0.0

    def lines(self) -> list[str]:
        size = f"{self.store_bytes / 2**20:,.1f} MiB"
        lines = [
            f"{'dry run' if self.dry_run else 'store'} {self.dataset_id[:16]}…" if self.dataset_id else "dry run",
            f"  samples      {self.samples:,} ({self.truncated:,} truncated, "
            f"{self.dropped_leading_assistant:,} with a leading assistant turn dropped)",
            f"  rejected     {self.rejected:,}" + "".join(
                f"\n    {reason:<28}{count:,}" for reason, count in sorted(self.rejected_by_reason.items())),
            f"  tokens       {self.tokens:,} ({self.loss_tokens:,} loss tokens)",
        ]
        if self.dry_run:
            lines.append(f"  est. size    {size} ({self.bytes_per_token:,.0f} bytes/token + head "
                         f"{self.head_bytes / 2**20:,.1f} MiB)")
            return lines
        lines += [
            f"  shards       {self.shards:,} ({self.shards_resumed:,} kept from an earlier run, "
            f"{self.actors} forward actor(s) on {self.nodes} node(s) in this run)",
            f"  speed        {self.tokens_per_second:,.0f} tokens/s over {self.forward_tokens:,} tokens "
            f"forwarded in {self.forward_seconds:,.1f}s (total {self.seconds:,.1f}s)",
            f"  store size   {size} ({self.bytes_per_token:,.0f} bytes/token + head {self.head_bytes / 2**20:,.1f} MiB)",
            f"  driver       {self.driver_peak_rss_mib:,.0f} MiB peak resident memory",
        ]
        return lines
