#!/usr/bin/env bash
# Stop everything slurm/local/start.sh started: jobs, the slurmd "nodes",
# slurmctld, slurmdbd, mariadb and munge. Idempotent; never fails when already
# stopped. State (job ids, accounting DB) is kept for the next start.sh;
# `stop.sh --purge` also deletes $LOCAL_SLURM_DIR for a fresh cluster.
set -euo pipefail

DIR=${LOCAL_SLURM_DIR:-/tmp/overlapkit-slurm}
export SLURM_CONF=$DIR/etc/slurm.conf
purge=0; [ "${1:-}" = --purge ] && purge=1

alive() { [ -n "$1" ] && [ -r "/proc/$1/status" ] && ! grep -q '^State:.*Z' "/proc/$1/status"; }

# Pids whose mount namespace is $1, e.g. "mnt:[4026532301]" (zombies have none).
# One find instead of a readlink per process: this is polled in a loop.
ns_pids() { local pat=${1//[/\\[}; pat=${pat//]/\\]}
  find /proc/[0-9]*/ns/mnt -maxdepth 0 -lname "$pat" 2>/dev/null | cut -d/ -f3; return 0; }

# kill_ns FILE: end every process in the mount namespace recorded in FILE by
# start.sh: a Slurm daemon and, for a node, every job step it spawned there.
# The namespace is private to that daemon, so nothing else is touched; never
# act on our own namespace (a stale or empty file).
kill_ns() { local f=$1 ns pids; ns=$(cat "$f" 2>/dev/null || true)
  if [ -n "$ns" ] && [ "$ns" != "$(readlink /proc/self/ns/mnt)" ]; then
    mapfile -t pids < <(ns_pids "$ns")
    [ "${#pids[@]}" -eq 0 ] || kill -TERM "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 100); do [ -z "$(ns_pids "$ns")" ] && break; sleep 0.2; done
    mapfile -t pids < <(ns_pids "$ns")
    [ "${#pids[@]}" -eq 0 ] || kill -KILL "${pids[@]}" 2>/dev/null || true
  fi
  rm -f "$f" "${f%.mntns}.pid"; }

# stop_pid PIDFILE COMM: TERM the process (if it is still the program COMM, not
# a recycled pid), wait up to 30 s for a clean shutdown, then KILL.
stop_pid() { local p; p=$(cat "$1" 2>/dev/null || true)
  if alive "$p" && [ "$(cat "/proc/$p/comm")" = "$2" ]; then
    kill -TERM "$p" 2>/dev/null || true
    for _ in $(seq 150); do alive "$p" || break; sleep 0.2; done
    ! alive "$p" || kill -KILL "$p" 2>/dev/null || true
  fi
  rm -f "$1"; }

if [ -d "$DIR" ]; then
  # Cancel jobs first while slurmctld is up, so accounting records CANCELLED
  # instead of leaving them RUNNING in the database.
  if [ -f "$SLURM_CONF" ] && timeout 5 scontrol ping >/dev/null 2>&1; then
    mapfile -t jobs < <(timeout 10 squeue -h -o %A 2>/dev/null || true)
    [ "${#jobs[@]}" -eq 0 ] || timeout 10 scancel "${jobs[@]}" 2>/dev/null || true
  fi
  for f in "$DIR"/run/slurmd-*.mntns; do [ -e "$f" ] && kill_ns "$f"; done
  for f in "$DIR"/run/slurmctld.mntns "$DIR"/run/slurmdbd.mntns; do [ -e "$f" ] && kill_ns "$f"; done
  stop_pid "$DIR/mysql/mysqld.pid" mariadbd
  stop_pid "$DIR/munge/run/munged.pid" munged
fi

# Drop the /etc/slurm/slurm.conf link start.sh made, but only if it is ours.
if [ -L /etc/slurm/slurm.conf ] && [ "$(readlink /etc/slurm/slurm.conf)" = "$SLURM_CONF" ]; then
  rm -f /etc/slurm/slurm.conf
fi
[ "$purge" = 0 ] || rm -rf "$DIR"
if [ "$purge" = 1 ]; then echo "local slurm stopped, $DIR removed"; else echo "local slurm stopped"; fi
