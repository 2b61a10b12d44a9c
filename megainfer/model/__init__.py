"""The MoE model, cut where the network cuts it: AttentionLayer and ExpertLayer."""
