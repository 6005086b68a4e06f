"""`adaflash generate --traffic-dir DIR`: keep what was served as traffic for distillation.

Each finished request becomes one :class:`~sglang_adaflash.serving.traffic.TrafficRecord`,
written through a :class:`~sglang_adaflash.serving.traffic.TrafficWriter`, so the reference
engine produces exactly the shards a serving writer would, and `adaflash distill --home HOME`
learns from them. DIR is a writer directory, `HOME/traffic/<writer>`: the job reads every
`HOME/traffic/*/`, so a directory of any other shape would collect records no round ever sees,
and it is refused instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..launch.prompts import CLIError


class TrafficSink:
    """Writes finished requests of one CLI run to a writer directory (closed on exit)."""

    def __init__(self, directory: str | Path, *, model: str, drafter_version: str | None,
                 include_text: bool = False, target_digest: str | None = None):
        from ..serving.traffic import TrafficError, TrafficWriter

        d = Path(directory)
        if d.parent.name != "traffic":
            raise CLIError(f"--traffic-dir {directory} must be HOME/traffic/<writer> (e.g. "
                           "$ADAFLASH_HOME/traffic/my-laptop): the distillation job reads "
                           "HOME/traffic/*/ only")
        try:
            self.writer = TrafficWriter(d.parent.parent, d.name, include_text=include_text)
        except TrafficError as e:
            raise CLIError(f"--traffic-dir: {e}") from None
        except OSError as e:
            raise CLIError(f"--traffic-dir {directory} cannot be written: {e}") from None
        self.model, self.drafter_version = model, drafter_version
        self.target_digest = target_digest
        self.written = 0

    def write(self, out, sampling, tokenizer=None, request_id: str | None = None) -> None:
        """One engine output; refused and empty requests are no traffic and are skipped.

        ``request_id``: the prompt's own id (the engine's ids are positional within a run).
        """
        from ..serving.traffic import TrafficRecord

        if not out.ok or not out.output_ids:
            return
        text = {}
        if self.writer.include_text and tokenizer is not None:
            text = {"prompt_text": tokenizer.decode(out.prompt_ids),
                    "output_text": tokenizer.decode(out.output_ids)}
        self.writer.write(TrafficRecord(
            id=request_id or out.request_id, model=self.model, drafter_version=self.drafter_version,
            prompt_ids=list(out.prompt_ids), output_ids=list(out.output_ids),
            sampling={"temperature": sampling.temperature, "top_p": sampling.top_p,
                      "top_k": sampling.top_k},
            accept_lens=list(out.stats.accept_lens), finish_reason=out.finish_reason,
            domain=out.domain, target_digest=self.target_digest, **text))
        self.written += 1

    def close(self) -> None:
        self.writer.close()


def drafter_version_of(drafter_dir: str | Path | None) -> str | None:
    """The version a drafter directory was published as (its manifest), else its name."""
    if drafter_dir is None:
        return None
    d = Path(drafter_dir)
    try:
        version = json.loads((d / "manifest.json").read_text()).get("version")
    except (OSError, ValueError, AttributeError):
        version = None
    return version if isinstance(version, str) and version else d.name


def open_sink(args, mode: str) -> TrafficSink | None:
    directory = getattr(args, "traffic_dir", None)
    if not directory:
        return None
    from ..serving.traffic import target_digest_of

    drafter = getattr(args, "drafter", None) if mode != "ar" else None
    return TrafficSink(directory, model=Path(str(args.target)).name,
                       drafter_version=drafter_version_of(drafter),
                       target_digest=target_digest_of(args.target))
