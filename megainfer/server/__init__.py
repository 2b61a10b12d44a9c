"""The gRPC frontend (megainfer.v1.Inference) over a generation backend."""
