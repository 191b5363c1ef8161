#!/bin/sh
# System libraries the Mooncake Store client needs (libibverbs1, even for TCP transport).
# Installs them with apt-get when missing and permitted; otherwise says so and carries on
# (the Mooncake tests then skip with that reason).
if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
    exit 0
fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null && exit 0
fi
echo "note: libibverbs1 is missing and could not be installed; Mooncake L3 is unavailable" >&2
exit 0
