"""The CPU a benchmark ran on is recorded with its figures (sglang_adaflash.bench.machine)."""

import torch

from sglang_adaflash.bench.machine import cpu_description


def test_the_model_name_is_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654 96-Core Processor\n"
                    "flags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 9654 96-Core Processor\n")
    got = cpu_description(info)
    assert got["model"] == "AMD EPYC 9654 96-Core Processor"
    assert got["torch_capability"] == torch.backends.cpu.get_cpu_capability()


def test_an_unreadable_or_nameless_cpuinfo_records_no_model(tmp_path):
    assert cpu_description(tmp_path / "absent")["model"] is None
    (tmp_path / "bare").write_text("processor\t: 0\nmodel name\t:\n")
    assert cpu_description(tmp_path / "bare")["model"] is None
