#!/usr/bin/env bash
# Start a throw-away single-node Slurm cluster (munged + slurmctld + slurmd) on this machine, everything under DIR.
#
#   bash tools/ci/start_slurm.sh DIR        # then: export SLURM_CONF=DIR/slurm.conf; sbatch ...
#   bash tools/ci/stop_slurm.sh DIR
#
# For CI and local testing of the examples/slurm recipes (tests/test_slurm.py); needs root. Installs the Debian
# packages slurm-wlm and munge with apt-get when they are missing. Cgroup-free (proctrack/linuxproc, task/none),
# no accounting: wait for jobs with `sbatch --wait` and read their state with `scontrol show job`.
# The node is called localhost, has this machine's CPUs and FAKE_GPUS gres/gpu (default 8, no devices behind
# them), so a GPU recipe's `#SBATCH --gpus-per-node=8` is accepted unmodified.
# Environment: SLURMCTLD_PORT (6817), SLURMD_PORT (6818), FAKE_GPUS (8).
# Exit status: 0 when the node is idle and takes jobs; 3 when Slurm is absent and apt-get cannot install it;
# 1 otherwise (the daemons' logs are in DIR/log).
set -euo pipefail
DIR=${1:?usage: start_slurm.sh DIR}
CTLD_PORT=${SLURMCTLD_PORT:-6817}
SLURMD_PORT=${SLURMD_PORT:-6818}
FAKE_GPUS=${FAKE_GPUS:-8}

have_slurm() { command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged; } >/dev/null
if ! have_slurm; then
  echo "start_slurm.sh: installing slurm-wlm and munge with apt-get" >&2
  start=$SECONDS
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
         slurm-wlm munge; } >&2 || ! have_slurm; then
    echo "start_slurm.sh: Slurm is not installed and apt-get could not install slurm-wlm munge" >&2
    exit 3
  fi
  echo "start_slurm.sh: apt-get install took $((SECONDS - start)) s" >&2
fi

mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"

# munge: a private key and socket, so a system munged (if any) is left alone.
dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 status=none
chmod 400 "$DIR/munge.key"
munged --force --socket="$DIR/munge.socket" --key-file="$DIR/munge.key" --pid-file="$DIR/munged.pid" \
  --seed-file="$DIR/munged.seed" --log-file="$DIR/log/munged.log"

# Fake GPUs: gres/gpu needs one device file per GPU; links to /dev/null are character devices that do nothing.
mkdir -p "$DIR/dev"
for ((i = 0; i < FAKE_GPUS; i++)); do ln -sfn /dev/null "$DIR/dev/gpu$i"; done
if ((FAKE_GPUS > 0)); then
  echo "NodeName=localhost Name=gpu File=$DIR/dev/gpu[0-$((FAKE_GPUS - 1))]" >"$DIR/gres.conf"
  node_gres="Gres=gpu:$FAKE_GPUS"
else
  : >"$DIR/gres.conf"
  node_gres=""
fi
cat >"$DIR/slurm.conf" <<CONF
ClusterName=localci
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
MinJobAge=600
GresTypes=gpu
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$(nproc) $node_gres State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONF

export SLURM_CONF=$DIR/slurm.conf
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF" -N localhost

for _ in $(seq 100); do
  state=$(sinfo -h -N -n localhost -o %T 2>/dev/null || true)
  if [ "$state" = idle ]; then
    echo "start_slurm.sh: node localhost is idle; export SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  sleep 0.2
done
echo "start_slurm.sh: node localhost did not become idle (state: ${state:-none}); see $DIR/log" >&2
exit 1
