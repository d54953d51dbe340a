#!/usr/bin/env bash
# A gray release with curl: conversations stream while traffic moves from model v1 to v2.
#
# Starts four fake GPU backends (two serving "v1", two "v2"), muxproxy in front of them with an
# admin listener, and a load of multi-turn conversations (half sticky by the X-Chat-ID header,
# half by the proxy's sticky cookie). While they stream, it moves the weights v1 -> v2 in steps
# of 25 % through the admin API, drains one v1 backend, then removes it with a reload. At the
# end it prints, per step, how many new conversations landed on v2, and the number of failed
# or incomplete streams and of conversations that changed server while it was up (all 0).
#
#   examples/gray-release.sh            # needs muxproxy installed (pip install .) and curl
#
# Everything listens on 127.0.0.1; every process it starts is stopped on exit.
set -euo pipefail

BASE_PORT=${BASE_PORT:-18100}
PROXY=127.0.0.1:$BASE_PORT
ADMIN=127.0.0.1:$((BASE_PORT + 1))
TOKEN=gray-release-demo-token
CONVERSATIONS_PER_STEP=${CONVERSATIONS_PER_STEP:-20}
TURNS=3
TOKENS=8

work=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

backend() { # NAME PORT VERSION
    muxproxy fakellm --id "$1" --port "$2" --model-version "$3" --tokens "$TOKENS" \
        --delay 0.02 >"$work/$1.log" 2>&1 &
    pids+=($!)
}
backend v1a $((BASE_PORT + 11)) v1
backend v1b $((BASE_PORT + 12)) v1
backend v2a $((BASE_PORT + 21)) v2
backend v2b $((BASE_PORT + 22)) v2

config() { # the configuration, with or without v1a
    local v1a="$1"
    cat <<EOF
[[listeners]]
address = "$PROXY"

[admin]
address = "$ADMIN"
token = "$TOKEN"
state_file = "$work/state.json"

[upstreams.gpus]
servers = [
$v1a
  { address = "127.0.0.1:$((BASE_PORT + 12))", weight = 4 },
  { address = "127.0.0.1:$((BASE_PORT + 21))", weight = 0 },
  { address = "127.0.0.1:$((BASE_PORT + 22))", weight = 0 },
]

[upstreams.gpus.sticky]
sources = ["header:X-Chat-ID"]
[upstreams.gpus.sticky.cookie]
name = "mux_srv"

[[routes]]
prefix = "/"
upstream = "gpus"
EOF
}
config "  { address = \"127.0.0.1:$((BASE_PORT + 11))\", weight = 4 }," >"$work/muxproxy.toml"
muxproxy check --config "$work/muxproxy.toml" >/dev/null
muxproxy serve --config "$work/muxproxy.toml" >"$work/proxy.log" 2>&1 &
pids+=($!)

wait_for() { # URL
    for _ in $(seq 100); do curl -s -o /dev/null "$1" && return 0; sleep 0.1; done
    echo "gray-release: $1 did not answer" >&2
    exit 1
}
for port in 11 12 21 22; do wait_for "http://127.0.0.1:$((BASE_PORT + port))/health"; done
wait_for "http://$ADMIN/status"

admin() { # METHOD PATH [JSON]
    curl -sS -f -X "$1" -H "Authorization: Bearer $TOKEN" \
        ${3:+-H "Content-Type: application/json" --data "$3"} "http://$ADMIN$2" >/dev/null
}
weight() { # SERVER_PORT WEIGHT
    admin PATCH "/upstreams/gpus/servers/127.0.0.1:$1" "{\"weight\": $2}"
}

conversation() { # ID STEP KIND -> one line per turn: id step turn backend version complete
    local id=$1 step=$2 kind=$3 jar="$work/jar.$1" turn out
    for turn in $(seq "$TURNS"); do
        local args=(-sS -N -D "$work/head.$id" -o "$work/body.$id" -X POST
            -H "Content-Type: application/json"
            --data '{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}')
        if [ "$kind" = header ]; then
            args+=(-H "X-Chat-ID: chat-$id")
        else
            args+=(-b "$jar" -c "$jar")
        fi
        if curl "${args[@]}" "http://$PROXY/v1/chat/completions"; then
            out=$(grep -c '"content":"tok' "$work/body.$id" || true)
            grep -q '^data: \[DONE\]' "$work/body.$id" || out=0
        else
            out=0
        fi
        local server version
        server=$(tr -d '\r' <"$work/head.$id" | awk -F': ' 'tolower($1)=="x-backend-id"{print $2}')
        version=$(tr -d '\r' <"$work/head.$id" | awk -F': ' 'tolower($1)=="x-model-version"{print $2}')
        echo "$id $step $turn ${server:-none} ${version:-none} $([ "$out" = "$TOKENS" ] && echo ok || echo FAILED)"
    done
}

results="$work/results"
: >"$results"
talks=()
run_step() { # STEP: start this step's conversations in the background
    local step=$1 n
    for n in $(seq "$CONVERSATIONS_PER_STEP"); do
        local id="$step-$n" kind=header
        [ $((n % 2)) = 0 ] && kind=cookie
        conversation "$id" "$step" "$kind" >>"$results" &
        talks+=($!)
    done
}

# Steps of 25 %: v1 4+4 / v2 0+0, 3/1, 2/2, 1/3, 0/4.
for step in 0 1 2 3 4; do
    v1=$((4 - step)) v2=$step
    for port in 11 12; do weight $((BASE_PORT + port)) $v1; done
    for port in 21 22; do weight $((BASE_PORT + port)) $v2; done
    echo "step $step: v1 weight $v1, v2 weight $v2"
    run_step "$step"
    sleep 0.5
done
admin PATCH "/upstreams/gpus/servers/127.0.0.1:$((BASE_PORT + 11))" '{"drain": true}'
echo "drained v1a"
config "" >"$work/muxproxy.toml"
admin POST /reload
echo "reloaded without v1a"
wait "${talks[@]}"

echo
echo "step  conversations  on v2  (expected share of v2)"
for step in 0 1 2 3 4; do
    total=$(awk -v s="$step" '$2==s && $3==1' "$results" | wc -l)
    on_v2=$(awk -v s="$step" '$2==s && $3==1 && $5=="v2"' "$results" | wc -l)
    printf "%4d  %13d  %5d  (%d %%)\n" "$step" "$total" "$on_v2" $((step * 25))
done
failed=$(grep -c FAILED "$results" || true)
moved=$(awk '$3==1{first[$1]=$4} $3>1 && $4!=first[$1] && first[$1]!="v1a"{n++} END{print n+0}' "$results")
echo
echo "streams: $(wc -l <"$results"), failed or incomplete: $failed"
echo "conversations that changed server while it was up: $moved"
[ "$failed" = 0 ] && [ "$moved" = 0 ]
