"""`ascend-dist doctor`'s Ascend checks (issue 25 item 6), through fakes of our own `AscendHost` Protocol.

Before: doctor checked nothing Ascend-specific. Each failure must print its fix; on a host that is
not an Ascend host the checks say so once, cleanly, and block nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

from ascend_dist.cli.ascend_probes import NpuRuntime, SystemAscendHost, ascend_findings
from ascend_dist.cli.probes import Finding


@dataclass
class FakeHost:
    """An Ascend host as the probes see it; each field one fact (an exception where reading it fails)."""

    markers: list[str] = field(default_factory=lambda: ["/dev/davinci0", "ASCEND_HOME_PATH=/usr/local/Ascend"])
    cann: str | None = "8.1.RC1"
    hccl: str | OSError = "/usr/local/Ascend/ascend-toolkit/latest/lib64/libhccl.so"
    runtime: NpuRuntime = field(default_factory=lambda: NpuRuntime("2.5.1", "2.5.1.post1", 8, ""))
    components: tuple[list[str], list[str]] | str = (["kv_connector:MooncakeConnectorV1", "startup:eplb"],) * 2

    def ascend_markers(self) -> list[str]:
        return self.markers

    def cann_version(self) -> str | None:
        return self.cann

    def load_hccl(self) -> str:
        if isinstance(self.hccl, OSError):
            raise self.hccl
        return self.hccl

    def npu_runtime(self) -> NpuRuntime:
        return self.runtime

    def vllm_components(self) -> tuple[list[str], list[str]] | str:
        return self.components


def _by_part(findings: list[Finding]) -> dict[str, Finding]:
    return {f.part: f for f in findings}


def test_a_healthy_ascend_host_passes_every_check() -> None:
    found = _by_part(ascend_findings(FakeHost()))
    assert set(found) == {"ascend host", "CANN", "libhccl", "torch_npu", "NPU devices", "vLLM registrations"}
    assert all(f.status == "ok" for f in found.values()), found
    assert "8 visible" in found["NPU devices"].detail


def test_not_an_ascend_host_is_one_clean_line_that_blocks_nothing() -> None:
    (only,) = ascend_findings(FakeHost(markers=[]))
    assert only.part == "ascend host" and "not an Ascend host" in only.detail
    assert not only.blocking and only.status == "ok"


def test_each_failure_is_blocking_and_names_its_fix() -> None:
    broken = FakeHost(
        cann=None,
        hccl=OSError("libhccl.so: cannot open shared object file"),
        runtime=NpuRuntime("2.6.0", "2.5.1.post1", 0, ""),
        components=(["kv_connector:MooncakeConnectorV1", "startup:eplb"], ["kv_connector:MooncakeConnectorV1"]),
    )
    found = _by_part(ascend_findings(broken))
    for part, fix in [
        ("CANN", "set_env.sh"),
        ("libhccl", "HCCL_SO_PATH"),
        ("torch_npu", "pip install 'torch-npu==2.6.0"),
        ("NPU devices", "ASCEND_RT_VISIBLE_DEVICES"),
        ("vLLM registrations", "startup:eplb"),
    ]:
        assert found[part].status == "missing" and found[part].blocking, (part, found[part])
        assert fix in found[part].fix or fix in found[part].detail, (part, found[part])


def test_torch_npu_that_cannot_import_quotes_its_error_and_the_cann_it_saw() -> None:
    runtime = NpuRuntime("2.5.1", None, 0, "ImportError: libascendcl.so: cannot open shared object file")
    found = _by_part(ascend_findings(FakeHost(runtime=runtime)))
    assert found["torch_npu"].status == "missing"
    assert "libascendcl.so" in found["torch_npu"].detail and "8.1.RC1" in found["torch_npu"].detail
    assert "set_env.sh" in found["torch_npu"].fix
    assert found["NPU devices"].status == "missing"  # nothing can see a device without torch_npu


def test_cann_version_is_read_from_the_toolkit_files(tmp_path) -> None:
    latest = tmp_path / "ascend-toolkit" / "latest"
    (latest / "compiler").mkdir(parents=True)
    (latest / "compiler" / "version.info").write_text("Version=8.0.RC3\nversion_dir=8.0.RC3\n")
    host = SystemAscendHost(environ={"ASCEND_TOOLKIT_HOME": str(latest)}, roots=())
    assert host.cann_version() == "8.0.RC3"
    assert any("ASCEND_TOOLKIT_HOME" in m for m in host.ascend_markers())
    assert SystemAscendHost(environ={}, roots=(), dev=tmp_path).ascend_markers() == []


def test_the_real_doctor_on_this_cpu_host_says_not_an_ascend_host() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND")} | {"ASCEND_DIST_DEVICE": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", "from ascend_dist.cli.ascend_probes import probe_ascend; print(probe_ascend())"],
        capture_output=True, text=True, timeout=60, env=env, check=True,
    )  # fmt: skip
    assert "not an Ascend host" in proc.stdout and "'missing'" not in proc.stdout, proc.stdout
