# ACL rules for a read-only rcctl token, legacy ACL system (Consul 0.7 to 1.3): `rcctl rc
# list|show`, `roll list|show`, `node list`, `farms`, `ping` work; every write is refused by
# Consul (rcctl exits 1 saying so). `rcctl audit` reads the SQL audit log, not Consul.

key "replication_controllers/" { policy = "read" }
key "lock/replication_controllers/" { policy = "read" }
key "lock/rolls/" { policy = "read" }
key "rolls/" { policy = "read" }
key "rcfarm/farms/" { policy = "read" }
key "rcfarm/rolls/" { policy = "read" }
key "rcfarm/history/" { policy = "read" }
key "rcfarm/failsafe/" { policy = "read" }
key "rcfarm/removals/" { policy = "read" }
key "labels/" { policy = "read" }
key "health/" { policy = "read" }
key "status/replication_controllers/" { policy = "read" }
key "audit_logs/" { policy = "read" }
