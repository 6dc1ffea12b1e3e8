# ACL policy for an rcfarm farm's token, in the ACL system of Consul 1.4 and later. The same
# rights as rcfarm-farm.legacy.hcl (the system of Consul 0.7 to 1.3), nothing else.
#   consul acl policy create -name rcfarm-farm -rules @rcfarm-farm.policy.hcl
#   consul acl token create -description "rcfarm farm" -policy-name rcfarm-farm
# A farm checks every key right at start and refuses to start naming any it lacks.

key_prefix "replication_controllers/" { policy = "write" }
key_prefix "lock/replication_controllers/" { policy = "write" }
key_prefix "lock/rolls/" { policy = "write" }
key_prefix "rolls/" { policy = "write" }
key_prefix "rcfarm/farms/" { policy = "write" }
key_prefix "rcfarm/rolls/" { policy = "write" }
key_prefix "rcfarm/history/" { policy = "write" }
# Operators' releases of held removals (rcctl farm release-removals writes them).
key_prefix "rcfarm/failsafe/" { policy = "read" }
# The cluster's removal window: every removal charges it in its own transaction.
key_prefix "rcfarm/removals/" { policy = "write" }
# Not needed with --audit-shipping off.
key_prefix "rcfarm/audit-shipper" { policy = "write" }
key_prefix "labels/node/" { policy = "read" }
key_prefix "labels/pod/" { policy = "write" }
key_prefix "labels/replication_controller/" { policy = "write" }
key_prefix "labels/rolls/" { policy = "write" }
key_prefix "intent/" { policy = "write" }
key_prefix "reality/" { policy = "read" }
key_prefix "health/" { policy = "read" }
key_prefix "status/replication_controllers/" { policy = "write" }
key_prefix "audit_logs/" { policy = "write" }
# With --scheduler pool only.
# key_prefix "scheduler/pool/reservations/" { policy = "write" }

# Sessions are registered against the node of the agent the farm talks to; "" covers any
# (narrow it to that agent's node name where farms use one agent each).
session_prefix "" { policy = "write" }
