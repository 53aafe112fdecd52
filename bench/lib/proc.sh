# Process accounting shared by the benchmark scripts (sourced): a process
# and its children (nginx master and workers), their CPU ticks and resident
# memory, from /proc.
family() { echo "$1"; cat /proc/"$1"/task/*/children 2>/dev/null | tr ' ' '\n' | grep . || true; }
cpu_ticks() { local t=0; for p in $(family "$1"); do t=$((t + $(awk '{print $14 + $15}' /proc/"$p"/stat 2>/dev/null || echo 0))); done; echo $t; }
# The kernel's share of those ticks (system time).
sys_ticks() { local t=0; for p in $(family "$1"); do t=$((t + $(awk '{print $15}' /proc/"$p"/stat 2>/dev/null || echo 0))); done; echo $t; }
rss_kb() { local t=0; for p in $(family "$1"); do t=$((t + $(awk '/^VmRSS/ {print $2}' /proc/"$p"/status 2>/dev/null || echo 0))); done; echo $t; }
HZ=$(getconf CLK_TCK)
