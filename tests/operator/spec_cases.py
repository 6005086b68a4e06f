"""Specs the CRD refuses, each with a word of the message: one table for the operator's own
check (tests/operator/test_units.py) and the API server's CEL and schema (tests/cluster), so
that the two sides of every rule stay in step."""

from __future__ import annotations

RWOP_JOBS_OFF = {"distillation": {"enabled": False}, "retention": {"enabled": False}}

# (spec overrides merged into a valid spec, a piece of the message)
REFUSED = [
    ({"serving": {"updateStrategy": {"maxSurge": 0, "maxUnavailable": 0}}},
     "may not both be 0"),
    ({"serving": {"updateStrategy": {"maxSurge": "0%", "maxUnavailable": "0%"}}},
     "may not both be 0"),
    ({"serving": {"updateStrategy": {"maxUnavailable": "150%"}}}, "up to '100%'"),
    ({"serving": {"updateStrategy": {"maxSurge": "two"}}}, "percentage such as"),
    ({"serving": {"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}}},
     "may not exceed its limit"),
    ({"serving": {"resources": {"requests": {"memory": "lots"}}}}, "must be a quantity"),
    ({"distillation": {"resources": {"requests": {"memory": "96Gi"},
                                     "limits": {"memory": "64Gi"}}}},
     "may not exceed its limit"),
    ({"replicas": 1, "storage": {"accessMode": "ReadWriteOncePod"}},
     "ReadWriteOncePod lets one pod"),
    ({"replicas": 1, "storage": {"accessMode": "ReadWriteOnce"},
      "serving": {"updateStrategy": {"maxSurge": 1, "maxUnavailable": 0}}},
     "maxSurge must be 0 with a ReadWriteOnce"),
    ({"replicas": 1, "storage": {"accessMode": "ReadWriteOnce"},
      "autoscaling": {"enabled": True, "maxReplicas": 3}}, "maxReplicas must be 1"),
    ({"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}},
     "must not exceed autoscaling.maxReplicas"),
    ({"distillation": {"backoffSeconds": 100, "maxBackoffSeconds": 10}},
     "maxBackoffSeconds must be >="),
    ({"replicas": 1, "storage": {"accessMode": "ReadWriteOncePod"}, **RWOP_JOBS_OFF,
      "drafter": {"bootstrap": {"source": "Train"}}}, "ReadWriteOncePod lets one pod"),
    ({"distillation": {"nodes": 2}, "storage": {"accessMode": "ReadWriteOnce"}},
     "distillation.nodes > 1"),
    ({"drafter": {"bootstrap": {"source": "Import"}}}, "bootstrap.path must be set"),
    ({"storage": {"size": "0Gi"}}, "storage.size"),
    ({"retention": {"schedule": "daily"}}, "retention.schedule"),
    ({"storage": {"existingClaim": "Not_A_Name"}}, "existingClaim"),
]

# Close to a refused one, and fine.
ACCEPTED = [
    {"serving": {"updateStrategy": {"maxSurge": 1, "maxUnavailable": 0}}},
    {"serving": {"updateStrategy": {"type": "Recreate", "maxSurge": 0, "maxUnavailable": 0}}},
    {"serving": {"updateStrategy": {"maxSurge": "25%", "maxUnavailable": "100%"}}},
    {"serving": {"resources": {"requests": {"cpu": "1500m"}, "limits": {"cpu": 2}}}},
    {"replicas": 1, "storage": {"accessMode": "ReadWriteOncePod"}, **RWOP_JOBS_OFF},
    {"replicas": 1, "storage": {"accessMode": "ReadWriteOnce"}},
    {"storage": {"existingClaim": "shared", "accessMode": "ReadWriteOnce"}, "replicas": 3},
    {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 2}},
    {"retention": {"schedule": "@daily"}},
    {"storage": {"size": "0.5Ti"}},
    {"distillation": {"nodes": 2}},
    {"distillation": {"nodes": 2}, "storage": {"existingClaim": "nfs"}},
    {"drafter": {"bootstrap": {"source": "Import", "path": "seed/dflash"}}},
    {"replicas": 1, "storage": {"accessMode": "ReadWriteOnce"},
     "drafter": {"bootstrap": {"source": "Train"}}},
]


def merged(base: dict, over: dict) -> dict:
    """`base` with `over` merged one level into its objects (serving, storage...)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
