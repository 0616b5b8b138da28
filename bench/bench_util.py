"""Small helpers the benchmark scripts share (no third-party imports)."""


def set_path(config, dotted, value):
    """Sets config["a"]["b"] from "a.b" and a value given on the command line (JSON if it parses)."""
    import json

    keys = dotted.split(".")
    for k in keys[:-1]:
        config = config.setdefault(k, {})
    try:
        config[keys[-1]] = json.loads(value)
    except json.JSONDecodeError:
        config[keys[-1]] = value


def status_bytes(key):
    """A byte figure of this process from /proc/self/status (VmHWM, VmRSS, ...), 0 if absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0
