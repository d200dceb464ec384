#!/usr/bin/env bash
# Start PostgreSQL, Redis and RabbitMQ where installed but not running; install
# a missing one with apt when root. Under CI=true a service that cannot be
# brought up fails the run; elsewhere the tests that need it are skipped.
set -uo pipefail
missing=()

wait_for() {  # name, command
  for _ in $(seq 1 60); do eval "$2" >/dev/null 2>&1 && return 0; sleep 1; done
  return 1
}

apt_install() {
  [ "$(id -u)" = 0 ] || return 1
  command -v apt-get >/dev/null || return 1
  [ -n "${APT_UPDATED:-}" ] || { apt-get update -qq >/dev/null 2>&1; APT_UPDATED=1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null 2>&1
}

pg_up() { pg_isready -h 127.0.0.1 -p 5432 -q; }
if ! pg_up 2>/dev/null; then
  command -v pg_ctlcluster >/dev/null || apt_install postgresql
  if command -v pg_ctlcluster >/dev/null; then
    for v in $(ls /etc/postgresql 2>/dev/null); do pg_ctlcluster --skip-systemctl-redirect "$v" main start 2>/dev/null; done
  fi
  wait_for postgres pg_up || missing+=("PostgreSQL on 127.0.0.1:5432")
fi
if pg_up 2>/dev/null; then
  psql -h 127.0.0.1 -U postgres -tAc "select 1 from pg_database where datname='test'" 2>/dev/null | grep -q 1 \
    || createdb -h 127.0.0.1 -U postgres test 2>/dev/null || true
  # the suite's xdist workers run kill -9 chaos runs side by side: PostgreSQL's default of 100
  # connections runs out ("too many clients"); raise it once (a restart) where we may
  max=$(psql -h 127.0.0.1 -U postgres -tAc "show max_connections" 2>/dev/null || echo 0)
  if [ "${max:-0}" -lt 300 ] && command -v pg_ctlcluster >/dev/null && [ "$(id -u)" = 0 ]; then
    psql -h 127.0.0.1 -U postgres -qc "alter system set max_connections = 300" >/dev/null 2>&1 \
      && for v in $(ls /etc/postgresql 2>/dev/null); do pg_ctlcluster --skip-systemctl-redirect "$v" main restart 2>/dev/null; done
    wait_for postgres pg_up || missing+=("PostgreSQL on 127.0.0.1:5432 (after raising max_connections)")
  fi
fi

redis_up() { redis-cli -h 127.0.0.1 -p 6379 ping | grep -q PONG; }
if ! redis_up 2>/dev/null; then
  command -v redis-server >/dev/null || apt_install redis-server
  if command -v redis-server >/dev/null; then
    mkdir -p /var/lib/redis /var/log/redis 2>/dev/null
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
      --dir /var/lib/redis --logfile /var/log/redis/ci.log >/dev/null 2>&1
  fi
  wait_for redis redis_up || missing+=("Redis on 127.0.0.1:6379")
fi

amqp_up() { (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; }
if ! amqp_up; then
  command -v rabbitmq-server >/dev/null || apt_install rabbitmq-server
  command -v rabbitmq-server >/dev/null && rabbitmq-server -detached >/dev/null 2>&1
  wait_for rabbitmq amqp_up || missing+=("RabbitMQ on 127.0.0.1:5672")
fi

nats_up() { (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null; }
if ! nats_up; then
  command -v nats-server >/dev/null || apt_install nats-server
  if command -v nats-server >/dev/null; then
    mkdir -p /var/lib/nats-server 2>/dev/null
    start-stop-daemon --start --oknodo --background --exec "$(command -v nats-server)" -- \
      -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log >/dev/null 2>&1
  fi
  wait_for nats nats_up || missing+=("NATS with JetStream on 127.0.0.1:4222")
fi

if ! command -v chromium >/dev/null 2>&1; then
  apt_install chromium || missing+=("Chromium (for the console's browser tests)")
fi

if ! ls /usr/lib/*/faketime/libfaketimeMT.so.1 /usr/lib/faketime/libfaketimeMT.so.1 >/dev/null 2>&1; then
  apt_install faketime || missing+=("libfaketime (apt package faketime, for the wall clock step tests)")
fi

if ! java -version >/dev/null 2>&1; then
  apt_install openjdk-17-jre-headless || missing+=("Java 17 (for Spark)")
fi

if [ ${#missing[@]} -gt 0 ]; then
  echo "services missing: ${missing[*]}" >&2
  if [ "${CI:-}" = "true" ]; then exit 1; fi
fi
exit 0
