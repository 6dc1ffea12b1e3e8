# ACL policy for a read-only rcctl token, Consul 1.4 and later (same rights as
# rcctl-readonly.legacy.hcl).
#   consul acl policy create -name rcctl-readonly -rules @rcctl-readonly.policy.hcl

key_prefix "replication_controllers/" { policy = "read" }
key_prefix "lock/replication_controllers/" { policy = "read" }
key_prefix "lock/rolls/" { policy = "read" }
key_prefix "rolls/" { policy = "read" }
key_prefix "rcfarm/farms/" { policy = "read" }
key_prefix "rcfarm/rolls/" { policy = "read" }
key_prefix "rcfarm/history/" { policy = "read" }
key_prefix "rcfarm/failsafe/" { policy = "read" }
key_prefix "rcfarm/removals/" { policy = "read" }
key_prefix "labels/" { policy = "read" }
key_prefix "health/" { policy = "read" }
key_prefix "status/replication_controllers/" { policy = "read" }
key_prefix "audit_logs/" { policy = "read" }
