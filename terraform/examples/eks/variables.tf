variable "region" {
  description = "AWS region of the EKS cluster."
  type        = string
  default     = "us-east-1"
}

variable "oidc_provider_arn" {
  description = "ARN of the EKS cluster's IAM OIDC provider (terraform-aws-modules/eks output oidc_provider_arn)."
  type        = string
}

variable "cluster_name" {
  description = "The EKS cluster to add a spot GPU node group to. Null: no node group (bring a Karpenter NodePool)."
  type        = string
  default     = null
}

variable "subnet_ids" {
  description = "Private subnets for the spot GPU node group (spread over several zones: spot capacity is per zone)."
  type        = list(string)
  default     = []
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete the bucket with its checkpoints (for trying the example out)."
  type        = bool
  default     = false
}

variable "tags" {
  description = "Tags on every resource."
  type        = map(string)
  default     = { project = "spotjob-example" }
}
