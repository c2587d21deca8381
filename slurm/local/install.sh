#!/usr/bin/env bash
# Install the Debian packages for the local single-host Slurm dev cluster.
# Idempotent: does nothing (not even `apt-get update`) when everything is present.
# Never starts services: there is no systemd here (PID 1 is not an init system),
# and start.sh launches every daemon by hand under $LOCAL_SLURM_DIR instead.
set -euo pipefail

# mariadb-server + slurmdbd: so `sacct` works (nemo_run polls sacct for job state).
# iproute2 (ip/ss) and util-linux (unshare, preinstalled): namespaces, checks.
# libpmix-dev: `srun --mpi=pmix` (what NeMo/Megatron launchers pass) dlopens
# pmix2/lib/libpmix.so, the unversioned name that only the -dev package ships;
# with just libpmix2 srun fails "can not load PMIx library".
PKGS=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server iproute2 libpmix-dev)

[ "$(id -u)" = 0 ] || { echo "install.sh: must run as root" >&2; exit 1; }

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "install.sh: all packages present (${PKGS[*]})"
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
# policy-rc.d exit 101 = "do not start services from maintainer scripts"; without it
# the postinst scripts try invoke-rc.d / systemctl and either fail or spawn daemons
# with the distro config that would fight with ours for ports and pid files.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod +x "$policy"; created_policy=1
fi
trap 'if [ "$created_policy" = 1 ]; then rm -f "$policy"; fi' EXIT

echo "install.sh: installing ${missing[*]}"
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install.sh: done"
