"""The CPU's identity as records and keys carry it: the name with family and model numbers, since a
VM's name alone ("AMD EPYC") does not tell the machine classes apart."""

from mtp_train.evaluation.machine import cpu_line, cpu_model, cpuinfo

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9R14
flags\t\t: fpu avx2 avx512f avx512_bf16
"""


def test_first_processor_only(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    info = cpuinfo(str(path))
    assert info["cpu family"] == "23" and info["model"] == "1" and info["model name"] == "AMD EPYC"
    assert "avx512f" not in info["flags"].split()


def test_the_model_names_family_and_model(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    zen1 = cpu_model(cpuinfo(str(path)))
    assert zen1 == "AMD EPYC (family 23 model 1)"
    assert zen1 != cpu_model({"model name": "AMD EPYC", "cpu family": "25", "model": "1"})
    assert cpu_model({"model name": "Some CPU"}) == "Some CPU"
    assert cpu_model(cpuinfo(str(tmp_path / "missing"))) != ""


def test_the_line_starts_with_the_model():
    assert cpu_line().startswith(cpu_model())
    assert cpu_line().endswith("threads")
