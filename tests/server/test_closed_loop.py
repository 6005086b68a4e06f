"""The loop on one machine, once round: `adaflash serve` writes traffic, `adaflash distill` learns
from it and publishes, the server hot-reloads the new version while serving, and T=0 outputs do
not move. A round on the tiny pair takes seconds."""

from __future__ import annotations

from sglang_adaflash.cli.main import main as cli_main

from .conftest import publish_pair_drafter, traffic_records

MODEL = "tiny"


def test_served_traffic_distils_into_a_version_the_server_reloads(pair, tmp_path, live_server, capsys):
    home = tmp_path / "home"
    v1 = publish_pair_drafter(home, pair)
    server = live_server(["--target", str(pair.target_dir), "--home", str(home), "--model-name", MODEL,
                          "--traffic-writer", "loop", "--reload-poll-s", "0.1"])
    client = server.openai()
    prompts = [f"{word} number {i}" for i, word in enumerate(["sum", "river", "list", "prime"] * 5)]
    before = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text for p in prompts}
    server.wait_for(lambda: len(traffic_records(home)) >= len(prompts), what="the traffic records")

    capsys.readouterr()
    code = cli_main(["distill", "--home", str(home), "--target", str(pair.target_dir), "--min-records", "16",
                     "--epochs", "1", "--batch-size", "4", "--anchors-per-seq", "4", "--head-steps", "2",
                     "--eval-max-new-tokens", "8", "--min-eval-records", "2", "--threads", "1", "--quiet"])
    assert code == 0, capsys.readouterr().err
    state = server.wait_for(lambda: (lambda s: s if s["loaded_version"] not in (None, v1) else None)(
        server.get("/adaflash/v1/drafter").json()), what="the distilled version to be loaded")
    v2 = state["loaded_version"]
    after = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True}) for p in prompts[:4]}
    assert {p: out.choices[0].text for p, out in after.items()} == {p: before[p] for p in prompts[:4]}
    assert {out.system_fingerprint for out in after.values()} == {v2}
