#!/usr/bin/env bash
# What the test suite needs besides .venv, installed on a fresh Linux machine; `make test` runs it first.
# Silent when everything is present. Never fails the test run: what cannot be installed here is named with the one
# command that installs it, and the tests that need it skip with the same reason.
# To add a requirement: one `need` line at the bottom (and, for a test, a skip when it is absent).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export DEBIAN_FRONTEND=noninteractive

on_path() { local found; found=$(command -v "$1") && [[ -x $found ]]; }  # bash also lists non-executables

can_apt() { [[ $(id -u) == 0 ]] && on_path apt-get; }

apt_get() { apt-get -qq -o DPkg::Lock::Timeout=300 "$@" >/dev/null; }  # waits for other jobs holding the lock

apt_install() {
  # A fresh machine (or container image) has no package lists, an old one stale lists: update, then retry once.
  apt-cache show "$@" >/dev/null 2>&1 || apt_get update || return 1
  apt_get install -y --no-install-recommends "$@" || { apt_get update && apt_get install -y --no-install-recommends "$@"; }
}

# need PRESENT_CHECK DEBIAN_PACKAGE WHAT_FOR [FALLBACK_INSTALL]: Debian's package when root with apt, otherwise the
# fallback command if one is given, otherwise a message naming the command to run.
need() {
  local present=$1 package=$2 purpose=$3 fallback=${4:-}
  eval "$present" && return 0
  echo "provision-tests: installing $package ($purpose)" >&2
  if can_apt && apt_install "$package" && eval "$present"; then
    return 0
  fi
  if [[ -n $fallback ]] && eval "$fallback" >&2 && eval "$present"; then
    return 0
  fi
  local command=${fallback:-"install $package with your system's package manager"}
  if on_path apt-get; then
    command="apt-get install -y $package"
    [[ $(id -u) == 0 ]] || command="sudo $command"
  fi
  echo "provision-tests: could not install $package; $purpose will be skipped. Run: $command" >&2
}

# Browser tests drive Chromium through Playwright: Debian's chromium on PATH, else Playwright's own build
# (tests/support/browser.py looks in the same two places).
playwright_chromium() {
  [[ -x $PY ]] && $PY - <<'EOF' 2>/dev/null
import os, sys
from playwright.sync_api import sync_playwright
with sync_playwright() as playwright:
    sys.exit(0 if os.path.exists(playwright.chromium.executable_path) else 1)
EOF
}
need "on_path chromium || playwright_chromium" chromium "the browser tests (UI)" \
  "$PY -m playwright install chromium"

# The SSH backend tests start their own sshd servers on loopback (tests/support/sshd.py). Debian's package would also
# start the system's sshd on port 22: sshd_not_to_be_run (honoured by its init script and systemd unit) prevents that.
if [[ ! -x /usr/sbin/sshd && $(id -u) == 0 ]]; then
  mkdir -p /etc/ssh && touch /etc/ssh/sshd_not_to_be_run
fi
need "[[ -x /usr/sbin/sshd ]]" openssh-server "the SSH backend tests (real sshd servers on loopback)"
# Test hosts on network stacks of their own (tests/support/netns.py: `ip netns`, veth, a bridge, `tc ... tbf`); without
# it (or without root) the SSH tests run their hosts on loopback addresses and say so.
need "on_path ip && on_path tc" iproute2 "test hosts on network stacks of their own"

# The Celery stack tests (tests/support/celery_stack.py) run their own Postgres cluster and redis-server on free ports.
# Debian's packages would also start the system's (a "main" cluster on 5432, redis-server on 6379): a policy-rc.d
# answering 101 ("action forbidden", honoured by invoke-rc.d and deb-systemd-invoke) holds them while installing,
# unless the image has its own, and a service that started all the same is stopped and disabled.
hold_services() {
  local policy=/usr/sbin/policy-rc.d status
  if [[ -e $policy || $(id -u) != 0 ]]; then "$@"; return; fi
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT  # even if this script is interrupted mid-install
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy"
  "$@"; status=$?
  rm -f "$policy"; trap - EXIT
  return $status
}
stop_service() {
  if [[ -d /run/systemd/system ]]; then systemctl disable --now "$1" >/dev/null 2>&1
  elif on_path service; then service "$1" stop >/dev/null 2>&1
  fi
  return 0
}
need_server() {  # need_server PRESENT_CHECK DEBIAN_PACKAGE SERVICE WHAT_FOR
  eval "$1" && return 0
  hold_services need "$1" "$2" "$4"
  eval "$1" && stop_service "$3"
}
postgres_present() { compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || on_path initdb; }
need_server "on_path redis-server" redis-server redis-server "the Celery stack tests (Postgres + Redis)"
need_server postgres_present postgresql postgresql "the Celery stack tests (Postgres + Redis)"
