"""Generated protobuf and gRPC code for protos/strata/v1 (scripts/gen_protos.sh); do not edit."""
