"""deploy/: the local recipe run on CPU, the other recipes checked statically.

The local script starts a real scheduler and workers on 127.0.0.1 (one
worker advertising GPU=1 without a GPU, one CPU worker) and the command
line fits against it: this exercises where the engine is placed. Docker,
Kubernetes and SLURM are not available here, so their files are parsed and
checked for the fields that make them work; none was built or applied.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from rh_dask.app.cli import EXIT_CLUSTER, EXIT_ENGINE, build_parser
from rh_dask.datasets import StreamSpec

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent


def _env() -> dict[str, str]:
    # The recipes call `dask` and `python` from PATH: the test's environment first.
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the recipe's process group (it and everything it started), then wait."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def _wait_for_workers(address: str, n: int, timeout: float = 60) -> list[dict]:
    from distributed import Client

    with Client(address, timeout=timeout) as client:
        client.wait_for_workers(n, timeout=timeout)
        info = client.scheduler_info(n_workers=-1)["workers"]
        return [{"address": a, **w} for a, w in info.items()]


def _rh_dask(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rh_dask", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
        env=_env(),
    )


@pytest.fixture
def parquet(tmp_path) -> Path:
    spec = StreamSpec(n_features=3, seed=11)
    path = tmp_path / "data.parquet"
    path.mkdir()
    for i in range(4):
        X, y = spec.chunk(i, 250)
        frame = pd.DataFrame(X, columns=["a", "b", "c"]).assign(y=y)
        frame.to_parquet(path / f"part-{i}.parquet", index=False)
    return path


# -- the local recipe, for real ------------------------------------------------------------
def test_local_script_places_the_engine_by_resources(tmp_path, parquet):
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    script = [str(DEPLOY / "local" / "start-cluster.sh"), "--port", str(port)]
    script += ["--gpu-slots-on-cpu", "1", "--cpu-workers", "1"]
    process = subprocess.Popen(
        script,
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: _stop reaches every child
    )
    try:
        workers = _wait_for_workers(address, 2)
        by_name = {w["name"]: w for w in workers}
        assert by_name["gpu-slot-0"]["resources"] == {"GPU": 1}
        assert by_name["cpu-0"]["resources"] == {}
        fit = ["fit", "--input", str(parquet), "--target", "y", "--scheduler", address]

        # auto: the cluster advertises a GPU, so the engine's actor goes to the GPU
        # worker and decides there at the first chunk; the GPU engine cannot start
        # here (no CuPy), so that worker runs the NumPy engine and the report says why.
        result = _rh_dask(*fit, "--output", "auto.npz", "--report", "auto", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        report = json.loads((tmp_path / "auto" / "report.json").read_text())
        assert report["engine"]["placement"]["worker"] == by_name["gpu-slot-0"]["address"]
        assert report["engine"]["name"] == "numpy"
        notes = report["engine"]["notes"]
        assert any("'auto' chose 'numpy'" in n and "cannot start" in n for n in notes), notes
        names = {w["name"] for w in report["hardware"]["cluster"]["workers"]}
        assert names == {"gpu-slot-0", "cpu-0"}

        # An explicit worker wins over the resource rule.
        gpu_slot = by_name["gpu-slot-0"]["address"]
        result = _rh_dask(
            *fit, "--engine", "numpy", "--worker", gpu_slot, "--output", "pinned.npz",
            "--report", "pinned", cwd=tmp_path,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        report = json.loads((tmp_path / "pinned" / "report.json").read_text())
        assert report["engine"]["placement"]["worker"] == gpu_slot

        # engine=gpu goes to the GPU=1 worker, which has no GPU engine: exit 5.
        result = _rh_dask(*fit, "--engine", "gpu", "--output", "gpu.npz", cwd=tmp_path)
        if result.returncode == 0:
            pytest.skip("a GPU engine started on this machine")
        assert result.returncode == EXIT_ENGINE, result.stderr
        assert "gpu" in result.stderr.lower()
    finally:
        _stop(process)
    assert process.returncode is not None
    # Nothing left listening on the scheduler port.
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_local_python_equivalent_starts_gpu_resource_workers(tmp_path):
    port = _free_port()
    command = [sys.executable, str(DEPLOY / "local" / "cluster.py"), "--cpu-as-gpu"]
    process = subprocess.Popen(
        [*command, "--port", str(port), "--workers", "1", "--threads", "1"],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        first = process.stdout.readline()
        assert f"tcp://127.0.0.1:{port}" in first
        workers = _wait_for_workers(f"tcp://127.0.0.1:{port}", 1)
        assert [w["resources"] for w in workers] == [{"GPU": 1}]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        _stop(process)


# -- shell scripts and the Dockerfile --------------------------------------------------------
@pytest.mark.parametrize("script", ["local/start-cluster.sh", "slurm/rh-dask-fit.sbatch"])
def test_shell_scripts_parse_and_are_executable(script):
    path = DEPLOY / script
    subprocess.run(["bash", "-n", str(path)], check=True)
    assert os.access(path, os.X_OK)


def test_sbatch_starts_cuda_workers_with_the_resource_and_runs_a_valid_fit():
    text = (DEPLOY / "slurm" / "rh-dask-fit.sbatch").read_text()
    assert re.search(r"^#SBATCH --gres=gpu:\d+", text, re.M)
    assert "dask scheduler --scheduler-file" in text
    assert re.search(r"dask cuda worker --scheduler-file \S+\s*\\?\s*--resources GPU=1", text)
    fit = text[text.rindex("rh-dask fit --") :].replace("\\\n", " ")
    args = shlex.split(fit.split("$FIT_ARGS")[0])[1:]
    values = {a: "x" for a in args if a.startswith('"$') or a.startswith("$")}
    parsed = build_parser().parse_args([values.get(a, a) for a in args])
    assert parsed.scheduler_file and parsed.report and parsed.no_progress


#: dask-cuda 26.10 pins dask and distributed through rapids-dask-dependency 26.10
#: (``dask>=2026.7.1,<2026.7.2``): the GPU image installs exactly that release.
DASK_CUDA_SERIES = "26.10"
DASK_CUDA_DASK = "2026.7.1"


def test_dockerfile_pins_dask_as_dask_cuda_does_and_copies_what_exists():
    project = (ROOT / "pyproject.toml").read_text()
    # Both gpu extras (cu12, cu13) follow the dask-cuda series the pin above belongs to.
    series = re.findall(r'"dask-cuda(?:\[[^\]]*\])?==([^"]+)"', project)
    assert len(series) == 2 and set(series) == {f"{DASK_CUDA_SERIES}.*"}, series
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}", text, re.M)
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:12\.\S+-runtime-", text, re.M)
    pins = dict(re.findall(r'"(dask|distributed)==([^"]+)"', text))
    assert pins == {"dask": DASK_CUDA_DASK, "distributed": DASK_CUDA_DASK}
    extras = re.findall(r'"/src\[([^\]]+)\]"', text)
    assert len(extras) == 1 and "gpu" in extras[0].split(","), extras
    for version in re.findall(r'"dask-cuda(?:\[[^\]]*\])?==([^"]+)"', text):
        assert version == f"{DASK_CUDA_SERIES}.*", version
    readme = (DEPLOY / "docker" / "README.md").read_text()
    assert f"dask-cuda {DASK_CUDA_SERIES}" in readme and DASK_CUDA_DASK in readme
    for source in re.findall(r"^COPY (.+) /src/?\S*$", text, re.M):
        for item in source.split():
            assert (ROOT / item).exists(), item
    lines = (DEPLOY / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
    ignore = [line for line in lines if line and not line.startswith("#")]
    assert ignore[0] == "*" and {"!rh_dask/**", "!gpu_engine/**", "!pyproject.toml"} <= set(ignore)


# -- compose and Kubernetes ----------------------------------------------------------------
def _command_line(args: list[str]) -> str:
    return " ".join(str(a) for a in args)


def test_compose_has_scheduler_gpu_and_cpu_workers_and_a_valid_job():
    compose = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"certs", "scheduler", "gpu-worker", "cpu-worker", "job"}
    images = {s["image"] for s in services.values()}
    assert len(images) == 1
    build = services["scheduler"]["build"]
    assert (DEPLOY / "docker" / build["context"] / build["dockerfile"]).is_file()
    assert _command_line(services["scheduler"]["command"]).startswith("dask scheduler")
    gpu = services["gpu-worker"]
    assert _command_line(gpu["command"]).startswith("dask cuda worker tls://scheduler:8786")
    assert "--resources GPU=1" in _command_line(gpu["command"])
    device = gpu["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert _command_line(services["cpu-worker"]["command"]).startswith("dask worker ")
    job = services["job"]["command"]
    assert job[:2] == ["rh-dask", "fit"]
    parsed = build_parser().parse_args(job[1:])
    assert parsed.scheduler == "tls://scheduler:8786"
    for name, service in services.items():
        assert name == "certs" or "./data:/data" in service["volumes"]


def _k8s() -> dict[str, list[dict]]:
    docs: dict[str, list[dict]] = {}
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs.setdefault(doc["kind"], []).append(doc)
    return docs


def test_kubernetes_gpu_worker_group_requests_a_gpu_and_advertises_it():
    docs = _k8s()
    (cluster,) = docs["DaskCluster"]
    (group,) = docs["DaskWorkerGroup"]
    assert cluster["apiVersion"] == group["apiVersion"] == "kubernetes.dask.org/v1"
    name = cluster["metadata"]["name"]
    assert group["spec"]["cluster"] == name
    (gpu,) = group["spec"]["worker"]["spec"]["containers"]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    args = _command_line(gpu["args"])
    assert args.startswith("dask cuda worker") and "--resources GPU=1" in args
    (cpu,) = cluster["spec"]["worker"]["spec"]["containers"]
    assert _command_line(cpu["args"]).startswith("dask worker")
    assert "nvidia.com/gpu" not in str(cpu.get("resources"))
    scheduler = cluster["spec"]["scheduler"]
    assert {p["port"] for p in scheduler["service"]["ports"]} >= {8786}
    assert scheduler["service"]["selector"]["dask.org/cluster-name"] == name
    images = {gpu["image"], cpu["image"], scheduler["spec"]["containers"][0]["image"]}
    (job,) = docs["Job"]
    (fit,) = job["spec"]["template"]["spec"]["containers"]
    images.add(fit["image"])
    assert len(images) == 1
    parsed = build_parser().parse_args(fit["args"][1:])
    # The operator names the scheduler service <cluster>-scheduler.
    assert parsed.scheduler == f"tls://{name}-scheduler:8786"
    (claim,) = docs["PersistentVolumeClaim"]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    pods = [
        cluster["spec"]["worker"]["spec"],
        group["spec"]["worker"]["spec"],
        job["spec"]["template"]["spec"],
    ]
    for pod in pods:
        claims = [
            v["persistentVolumeClaim"]["claimName"]
            for v in pod["volumes"]
            if "persistentVolumeClaim" in v
        ]
        assert claims == [claim["metadata"]["name"]]


def test_every_recipe_says_how_to_start_and_how_to_connect():
    for recipe in ("local", "docker", "kubernetes", "slurm"):
        text = (DEPLOY / recipe / "README.md").read_text()
        assert "## Start" in text and "## Connect" in text, recipe
    index = (DEPLOY / "README.md").read_text()
    for recipe in ("local", "docker", "kubernetes", "slurm"):
        assert f"({recipe}/README.md)" in index


# -- TLS in every recipe that listens beyond localhost ---------------------------------------
REQUIRE_ENCRYPTION = "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"


def _tls_files(args: list[str]) -> dict[str, str]:
    flags = ("--tls-ca-file", "--tls-cert", "--tls-key")
    return {a: b for a, b in itertools.pairwise(args) if a in flags}


def _role_files(directory: str, role: str) -> dict[str, str]:
    return {
        "--tls-ca-file": f"{directory}/ca.pem",
        "--tls-cert": f"{directory}/{role}.pem",
        "--tls-key": f"{directory}/{role}-key.pem",
    }


def _dashboard_host(args: list[str]) -> str:
    return args[args.index("--dashboard-address") + 1].rsplit(":", 1)[0]


def test_compose_speaks_only_mutual_tls_and_keeps_the_dashboard_local():
    services = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())["services"]
    certs = services["certs"]["command"]
    assert certs[:3] == ["rh-dask", "certs", "/certs"] and "--keep" in certs
    scheduler = services["scheduler"]["command"]
    assert scheduler[scheduler.index("--protocol") + 1] == "tls"
    assert _tls_files(scheduler) == _role_files("/certs", "scheduler")
    # The dashboard: the container's 127.0.0.1 unless RH_DASK_DASHBOARD opts in.
    assert _dashboard_host(scheduler) == "${RH_DASK_DASHBOARD:-127.0.0.1"
    assert services["scheduler"]["depends_on"]["certs"] == {
        "condition": "service_completed_successfully"
    }
    assert all(p.startswith("127.0.0.1:") for p in services["scheduler"]["ports"])
    for name in ("gpu-worker", "cpu-worker"):
        command = services[name]["command"]
        assert "tls://scheduler:8786" in command
        assert _tls_files(command) == _role_files("/certs", "worker")
        assert _dashboard_host(command) == "127.0.0.1"
    job = build_parser().parse_args(services["job"]["command"][1:])
    assert job.scheduler.startswith("tls://") and job.tls_dir == "/certs"
    for name, service in services.items():
        assert service["environment"][REQUIRE_ENCRYPTION] == "True", name
        mounts = [v for v in service["volumes"] if v.split(":")[1] == "/certs"]
        assert mounts == (["tls:/certs"] if name == "certs" else ["tls:/certs:ro"]), name
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    (extras,) = re.findall(r'"/src\[([^\]]+)\]"', dockerfile)
    assert "tls" in extras.split(",")  # cryptography, for rh-dask certs


def _container_env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def _secret_items(pod: dict) -> list[str]:
    (tls,) = [v for v in pod["volumes"] if "secret" in v]
    assert tls["secret"]["secretName"] == "rh-dask-tls"
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == tls["name"]]
    assert mount["mountPath"] == "/certs" and mount["readOnly"] is True
    # Readable by the image's user (uid 1000) through the pod's group.
    assert pod["securityContext"]["fsGroup"] == 1000
    assert tls["secret"]["defaultMode"] == 0o440
    return sorted(item["path"] for item in tls["secret"]["items"])


def test_kubernetes_speaks_only_mutual_tls_each_pod_holding_its_own_role():
    docs = _k8s()
    (cluster,) = docs["DaskCluster"]
    (group,) = docs["DaskWorkerGroup"]
    (job,) = docs["Job"]
    scheduler_pod = cluster["spec"]["scheduler"]["spec"]
    (scheduler,) = scheduler_pod["containers"]
    assert scheduler["args"][scheduler["args"].index("--protocol") + 1] == "tls"
    assert _tls_files(scheduler["args"]) == _role_files("/certs", "scheduler")
    assert _dashboard_host(scheduler["args"]) == "127.0.0.1"
    assert _container_env(scheduler)[REQUIRE_ENCRYPTION] == "True"
    assert _secret_items(scheduler_pod) == ["ca.pem", "scheduler-key.pem", "scheduler.pem"]
    # Only the TLS comm port is served: no dashboard port on the service.
    assert [p["port"] for p in cluster["spec"]["scheduler"]["service"]["ports"]] == [8786]
    name = cluster["metadata"]["name"]
    for pod in (cluster["spec"]["worker"]["spec"], group["spec"]["worker"]["spec"]):
        (worker,) = pod["containers"]
        assert worker["args"][worker["args"].index("worker") + 1] == f"tls://{name}-scheduler:8786"
        assert _tls_files(worker["args"]) == _role_files("/certs", "worker")
        assert _dashboard_host(worker["args"]) == "127.0.0.1"
        assert _container_env(worker)[REQUIRE_ENCRYPTION] == "True"
        assert _secret_items(pod) == ["ca.pem", "worker-key.pem", "worker.pem"]
    pod = job["spec"]["template"]["spec"]
    (fit,) = pod["containers"]
    parsed = build_parser().parse_args(fit["args"][1:])
    assert parsed.scheduler.startswith("tls://") and parsed.tls_dir == "/certs"
    assert _secret_items(pod) == ["ca.pem", "client-key.pem", "client.pem"]
    assert (
        "kubectl create secret generic rh-dask-tls"
        in (DEPLOY / "kubernetes" / "README.md").read_text()
    )


def test_sbatch_makes_credentials_and_speaks_only_tls():
    text = (DEPLOY / "slurm" / "rh-dask-fit.sbatch").read_text()
    flat = text.replace("\\\n", " ")
    assert re.search(r'^rh-dask certs "\$TLS_DIR" --keep', text, re.M)
    assert f"export {REQUIRE_ENCRYPTION}=True" in text
    scheduler = shlex.split(flat[flat.index("dask scheduler ") :].split("&")[0])
    assert scheduler[scheduler.index("--protocol") + 1] == "tls"
    assert _tls_files(scheduler) == _role_files("$TLS_DIR", "scheduler")
    worker = shlex.split(flat[flat.index("dask cuda worker ") :].split("&")[0])
    assert _tls_files(worker) == _role_files("$TLS_DIR", "worker")
    fit = shlex.split(flat[flat.rindex("rh-dask fit --") :].split("$FIT_ARGS")[0])
    assert fit[fit.index("--tls-dir") + 1] == "$TLS_DIR"


def test_local_script_refuses_a_public_host_without_tls(tmp_path):
    script = str(DEPLOY / "local" / "start-cluster.sh")
    result = subprocess.run(
        [script, "--host", "0.0.0.0"], capture_output=True, text=True, env=_env(), timeout=30
    )
    assert result.returncode == 2
    assert "add --tls-dir DIR" in result.stderr


@pytest.mark.slow
def test_local_script_with_tls_dir_speaks_only_mutual_tls(tmp_path):
    pytest.importorskip("cryptography")
    from distributed import Client

    from rh_dask.app.security import client_security

    port = _free_port()
    certs = tmp_path / "certs"
    script = [str(DEPLOY / "local" / "start-cluster.sh"), "--port", str(port)]
    script += ["--tls-dir", str(certs), "--gpu-slots-on-cpu", "1"]
    process = subprocess.Popen(
        script,
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"tls://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not (certs / "client-key.pem").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        security = client_security(address, tls_dir=str(certs))
        with Client(address, security=security, timeout=60) as client:
            client.wait_for_workers(1, timeout=60)
            workers = client.scheduler_info(n_workers=-1)["workers"]
            assert all(a.startswith("tls://127.0.0.1:") for a in workers)
            assert client.submit(sum, [1, 2]).result() == 3
        result = _rh_dask("attach", "none", "--scheduler", f"tcp://127.0.0.1:{port}", cwd=tmp_path)
        assert result.returncode == EXIT_CLUSTER, result.stderr
        assert "refuses plain tcp://" in result.stderr
    finally:
        _stop(process)
