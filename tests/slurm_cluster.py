"""A real Slurm cluster on this host for the tests: munged, slurmctld and two slurmd (nodes n1, n2),
from Debian's slurm-wlm and munge packages, with every file under one temporary folder.

Everything listens on 127.0.0.1 on ports picked free at start, so it clashes neither with a
system-wide Slurm nor with another cluster started at the same time. Clients reach it through
SLURM_CONF (see `Cluster.env`). `python tests/slurm_cluster.py` starts one and prints that line,
for trying the kit by hand; README, "SLURM", shows the slurm.conf it writes.
"""
from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from host import free_ports, program

# Debian's programs the cluster and its clients run (slurm-wlm, munge)
PROGRAMS = ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "scancel")
NODES = ("n1", "n2")
CPUS_PER_NODE = 4  # more than this host may have: each node runs a few CPU processes standing in for GPUs
FAKE_GPUS_PER_NODE = 2
START_TIMEOUT_S = 60

SLURM_CONF = """\
ClusterName=repro
FirstJobId={first_job_id}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
StateSaveLocation={root}/ctld
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
MinJobAge=300
KillWait=30
InactiveLimit=0
{gres_types}
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={node_ports[0]} CPUs={cpus} State=UNKNOWN {gres}
NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.1 Port={node_ports[1]} CPUs={cpus} State=UNKNOWN {gres}
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
PartitionName=down Nodes=n[1-2] MaxTime=INFINITE State=DOWN
PartitionName=inactive Nodes=n[1-2] MaxTime=INFINITE State=INACTIVE
"""


@dataclass
class Cluster:
    root: Path
    gpus: bool = False  # nodes declare fake GPU GRES (character devices made with mknod)
    daemons: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, squeue, scancel, repro) needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def write_config(self) -> None:
        user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
        ctld_port, *node_ports = free_ports(1 + len(NODES))
        gres_types, gres = "", ""
        if self.gpus:
            gres_types, gres = "GresTypes=gpu", f"Gres=gpu:{FAKE_GPUS_PER_NODE}"
            devices = self.root / "dev"
            devices.mkdir()
            lines = []
            for node in NODES:
                for index in range(FAKE_GPUS_PER_NODE):
                    device = devices / f"{node}-gpu{index}"
                    os.mknod(device, 0o666 | 0o020000, os.makedev(1, 3))  # a character device, like /dev/null
                    lines.append(f"NodeName={node} Name=gpu File={device}")
            (self.root / "gres.conf").write_text("AutoDetect=off\n" + "\n".join(lines) + "\n")
        self.conf.write_text(SLURM_CONF.format(
            host=socket.gethostname(), ctld_port=ctld_port, node_ports=node_ports, user=user, root=self.root,
            munge_socket=self.root / "munge" / "munge.socket", cpus=CPUS_PER_NODE, gres_types=gres_types, gres=gres,
            # job ids (and the rendezvous ports the kit derives from them) differ between clusters
            first_job_id=random.randrange(1000, 1_000_000),
        ))
        for folder in ("ctld", "spool"):
            (self.root / folder).mkdir()

    def start_munge(self, munged: str) -> None:
        state = self.root / "munge"
        state.mkdir(mode=0o700)
        key = state / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.daemons.append(subprocess.Popen([
            munged, "--foreground", "--force", f"--socket={state / 'munge.socket'}", f"--key-file={key}",
            f"--pid-file={state / 'munged.pid'}", f"--log-file={state / 'munged.log'}",
            f"--seed-file={state / 'munged.seed'}",
        ], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.wait_for(lambda: (state / "munge.socket").exists(), "munged's socket")

    def start(self) -> "Cluster":
        slurmctld, slurmd, munged = program("slurmctld"), program("slurmd"), program("munged")
        self.write_config()
        self.start_munge(munged)
        env = {**os.environ, **self.env}
        self.daemons.append(subprocess.Popen([slurmctld, "-D", "-i", "-f", str(self.conf)], env=env,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for node in NODES:
            self.daemons.append(subprocess.Popen([slurmd, "-D", "-N", node, "-f", str(self.conf)], env=env,
                                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.wait_for(self.nodes_idle, "both nodes idle")
        return self

    def nodes_idle(self) -> bool:
        out = self.client("sinfo", "--noheader", "--partition=debug", "--format=%T %D")
        return out.returncode == 0 and out.stdout.split() == ["idle", str(len(NODES))]

    def client(self, *command: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=30)

    def wait_for(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            dead = [d.args[0] for d in self.daemons if d.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.stop()
                logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.root.glob("*.log")))
                raise RuntimeError(f"Slurm test cluster: no {what} ({', '.join(dead) or 'timeout'} "
                                   f"after {START_TIMEOUT_S} s); logs:\n{logs}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Cancel every job (slurmd leaves running steps behind when it stops), then stop the daemons."""
        if len(self.daemons) == 2 + len(NODES):
            self.client("scancel", "--full", f"--user={os.getuid()}")
            deadline = time.monotonic() + 60
            while self.client("squeue", "--noheader").stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for daemon in reversed(self.daemons):
            daemon.terminate()
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        self.daemons.clear()


if __name__ == "__main__":
    import tempfile

    cluster = Cluster(Path(tempfile.mkdtemp(prefix="repro-slurm-"))).start()
    print(f"export SLURM_CONF={cluster.conf}   # Ctrl-C stops the cluster")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        cluster.stop()
