variable "project_id" {
  description = "The Google Cloud project of the GKE cluster."
  type        = string
}

variable "region" {
  description = "Region of the GKE cluster and the checkpoint bucket."
  type        = string
  default     = "us-central1"
}

variable "cluster" {
  description = "The GKE cluster (Workload Identity enabled) to add a spot GPU node pool to. Null: no node pool."
  type        = string
  default     = null
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete the bucket with its checkpoints (for trying the example out)."
  type        = bool
  default     = false
}
