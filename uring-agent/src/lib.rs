//! pillar: The fenced storage-node agent.
