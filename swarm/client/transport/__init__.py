"""The client's transport: the swarm view (DHT records, bans), routing over servers and coverage, inference
sessions and their span streams, verification, remote autograd for training, and the swarm's status.
"""
