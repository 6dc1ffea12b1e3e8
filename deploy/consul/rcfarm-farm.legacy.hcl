# ACL rules for an rcfarm farm's token, in the legacy ACL system (Consul 0.7 to 1.3; also
# accepted by 1.4-1.10 as a legacy token). Exactly what a farm reads and writes; nothing else.
# Key rules match by prefix. Create the token with:
#   curl -X PUT -H "X-Consul-Token: $MASTER" $CONSUL/v1/acl/create \
#     -d "{\"Name\": \"rcfarm farm\", \"Type\": \"client\", \"Rules\": $(jq -Rs . < rcfarm-farm.legacy.hcl)}"
# A farm checks every one of these rights at start and refuses to start naming any it lacks.

# The RCs it serves (writes: scale-downs of a finished roll, P2's records), their locks, and the
# locks of the rolls it carries out.
key "replication_controllers/" { policy = "write" }
key "lock/replication_controllers/" { policy = "write" }
key "lock/rolls/" { policy = "write" }
# Rolling updates (P2's rolls/<new-rc-id>), deleted when done.
key "rolls/" { policy = "write" }
# The farm registry: each farm's record under its session.
key "rcfarm/farms/" { policy = "write" }
# Operators' pause of a roll (rcctl roll pause), guarded by every roll write; deleted with the roll.
key "rcfarm/rolls/" { policy = "write" }
# Revision histories of RC lineages, moved to the new RC by each roll's completion.
key "rcfarm/history/" { policy = "write" }
# Operators' releases of held removals (rcctl farm release-removals writes them).
key "rcfarm/failsafe/" { policy = "read" }
# The cluster's removal window: every removal charges it in its own transaction.
key "rcfarm/removals/" { policy = "write" }
# The audit shipper's lock (one farm ships at a time); not needed with --audit-shipping off.
key "rcfarm/audit-shipper" { policy = "write" }
# Node labels are only read; pod, RC and roll labels are written with the pods and rolls.
key "labels/node/" { policy = "read" }
key "labels/pod/" { policy = "write" }
key "labels/replication_controller/" { policy = "write" }
key "labels/rolls/" { policy = "write" }
# Pod intents (what P2's preparer runs), written; what nodes run and their health, read.
key "intent/" { policy = "write" }
key "reality/" { policy = "read" }
key "health/" { policy = "read" }
# P2's node-transfer status per RC.
key "status/replication_controllers/" { policy = "write" }
# P2's audit records, written with every change and drained by the shipper.
key "audit_logs/" { policy = "write" }
# With --scheduler pool only: the pool's reservations.
# key "scheduler/pool/reservations/" { policy = "write" }

# Sessions: create, renew, destroy (Consul 0.8 to 1.3; 0.7 has no session ACLs and ignores it).
session "" { policy = "write" }
