variable "name" {
  description = "Prefix of every resource's name (bucket, roles, queue, rules, node group)."
  type        = string
  default     = "spotjob"

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{0,30}[a-z0-9]$", var.name))
    error_message = "name must be 2 to 32 lowercase letters, digits and '-', starting and ending with a letter or digit."
  }
}

variable "tags" {
  description = "Tags added to every resource that takes tags (the bucket, the roles, the queue, the rules, the node group): at most 50, keys of 1 to 128 and values of up to 256 letters, digits, spaces and _ . : / = + - @, no key beginning with aws:."
  type        = map(string)
  default     = {}

  # AWS keeps the aws: prefix (in any case) for itself: every service refused such a tag at apply,
  # after the resources before it were created, naming the resource and not this variable.
  validation {
    condition     = alltrue([for k in keys(var.tags) : !startswith(lower(k), "aws:")])
    error_message = "tags: no key may begin with aws: (in any case), which AWS keeps for its own tags and refuses on every resource; rename the key."
  }
  # What IAM and S3 (the strictest of the services tagged) take.
  validation {
    condition     = length(var.tags) <= 50 && alltrue([for k, v in var.tags : can(regex("^[\\p{L}\\p{Z}\\p{N}_.:/=+@-]{1,128}$", k)) && can(regex("^[\\p{L}\\p{Z}\\p{N}_.:/=+@-]{0,256}$", v))])
    error_message = "tags: at most 50 tags, each key 1 to 128 and each value up to 256 letters, digits, spaces and _ . : / = + - @ (what IAM and S3 take for a tag)."
  }
}

# -- checkpoint bucket ------------------------------------------------------------------------------

variable "bucket_name" {
  description = "The checkpoint bucket's name. Null: \"<name>-checkpoints-<account id>\"."
  type        = string
  default     = null

  validation {
    condition     = var.bucket_name == null || can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket_name))
    error_message = "bucket_name must be a valid S3 bucket name: 3 to 63 lowercase letters, digits, '.' and '-'."
  }
  # The rest of S3's naming rules: CreateBucket refused these at apply, after the plan had passed.
  validation {
    condition     = var.bucket_name == null || !can(regex("(\\.\\.|^[0-9]+\\.[0-9]+\\.[0-9]+\\.[0-9]+$|^xn--|^sthree-|^amzn-s3-demo-|-s3alias$|--ol-s3$|\\.mrap$|--x-s3$|--table-s3$)", var.bucket_name))
    error_message = "bucket_name must be a name S3 accepts: no two adjacent '.', not an IP address, not beginning with xn--, sthree- or amzn-s3-demo-, not ending in -s3alias, --ol-s3, .mrap, --x-s3 or --table-s3."
  }
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete the bucket with the checkpoints in it; false refuses the whole destroy before anything is removed. A destroy reads it from the state: apply it first. Keep false outside tests."
  type        = bool
  default     = false
}

variable "kms_key_arn" {
  description = "A KMS key in the bucket's region (the plan refuses another region's) for the bucket's server-side encryption (SSE-KMS, with an S3 bucket key). Null: SSE-S3 (AES256). The roles get kms:Decrypt and kms:GenerateDataKey on it."
  type        = string
  default     = null

  validation {
    condition     = var.kms_key_arn == null || can(regex("^arn:aws[a-z-]*:kms:[a-z0-9-]+:[0-9]{12}:key/.+$", var.kms_key_arn))
    error_message = "kms_key_arn must be the ARN of a KMS key (arn:aws:kms:REGION:ACCOUNT:key/ID)."
  }
}

variable "noncurrent_version_expiration_days" {
  description = "Days a checkpoint object stays recoverable after spotjob's retention deleted or replaced it (versioning keeps it as a noncurrent version), before S3 expires it. Current objects never expire: the newest valid checkpoint must never disappear."
  type        = number
  default     = 7

  validation {
    condition     = var.noncurrent_version_expiration_days >= 1 && floor(var.noncurrent_version_expiration_days) == var.noncurrent_version_expiration_days
    error_message = "noncurrent_version_expiration_days must be a whole number of days, at least 1."
  }
}

variable "abort_incomplete_multipart_upload_days" {
  description = "Days after which S3 aborts a multipart upload that never completed (a shard upload cut off by a preemption), freeing its parts."
  type        = number
  default     = 1

  validation {
    condition     = var.abort_incomplete_multipart_upload_days >= 1 && floor(var.abort_incomplete_multipart_upload_days) == var.abort_incomplete_multipart_upload_days
    error_message = "abort_incomplete_multipart_upload_days must be a whole number of days, at least 1."
  }
}

# -- identities (IRSA) ---------------------------------------------------------------------------------

variable "oidc_provider_arn" {
  description = "ARN of the EKS cluster's IAM OIDC provider (terraform-aws-modules/eks output oidc_provider_arn). The IRSA roles trust it."
  type        = string

  validation {
    condition     = can(regex("^arn:aws[a-z-]*:iam::[0-9]{12}:oidc-provider/.+$", var.oidc_provider_arn))
    error_message = "oidc_provider_arn must be an IAM OIDC provider ARN: arn:aws:iam::ACCOUNT:oidc-provider/oidc.eks.REGION.amazonaws.com/id/ID."
  }
}

variable "training_identities" {
  description = "One IRSA role per entry for training pods: pods running as service_account in namespace may read and write s3://<bucket>/<prefix>/ and nothing else. Jobs then use checkpoint URIs under that prefix. The map key names the role (\"<name>-training-<key>\")."
  type = map(object({
    namespace       = string
    service_account = string
    prefix          = string
  }))
  default = {}

  validation {
    condition     = alltrue([for k, v in var.training_identities : can(regex("^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", v.namespace))])
    error_message = "Each training_identities namespace must be a Kubernetes namespace name (a DNS label)."
  }
  validation {
    condition     = alltrue([for k, v in var.training_identities : can(regex("^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$", v.service_account))])
    error_message = "Each training_identities service_account must be a Kubernetes service account name."
  }
  validation {
    condition     = alltrue([for k, v in var.training_identities : can(regex("^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$", v.prefix))])
    error_message = "Each training_identities prefix must be a key prefix without leading or trailing '/', e.g. \"ml-training\" or \"teams/vision\"."
  }
  validation {
    condition = alltrue(flatten([
      for a in values(var.training_identities) : [
        for b in values(var.training_identities) : a.prefix == b.prefix || !startswith(b.prefix, "${a.prefix}/")
      ]
    ]))
    error_message = "No training_identities prefix may lie inside another's (\"a\" and \"a/b\"): the outer role could read and delete the inner one's checkpoints."
  }
  validation {
    condition     = alltrue([for k in keys(var.training_identities) : can(regex("^[a-z0-9][a-z0-9-]{0,30}$", k))])
    error_message = "training_identities keys name IAM roles: up to 31 lowercase letters, digits and '-'."
  }
}

variable "controller_namespace" {
  description = "Namespace of the spotjob Helm release (the controller's ServiceAccount)."
  type        = string
  default     = "spotjob-system"

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", var.controller_namespace))
    error_message = "controller_namespace must be a Kubernetes namespace name."
  }
}

variable "controller_service_account" {
  description = "Name of the controller's ServiceAccount (the chart's serviceAccount.name; the helm_values output sets it)."
  type        = string
  default     = "spotjob"

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$", var.controller_service_account))
    error_message = "controller_service_account must be a Kubernetes service account name."
  }
}

# -- interruption queue -----------------------------------------------------------------------------

variable "create_interruption_queue" {
  description = "Create spotjob's own SQS queue fed by EventBridge with EC2 spot interruption warnings, rebalance recommendations and instance state changes. It must be spotjob's alone: a message is consumed once, so never point Karpenter or aws-node-termination-handler at it (nor spotjob at theirs)."
  type        = bool
  default     = true
}

variable "queue_message_retention_seconds" {
  description = "How long an unread interruption message stays on the queue. A notice is stale after the two minutes it announces; 300 s rides out a controller restart."
  type        = number
  default     = 300

  validation {
    condition     = var.queue_message_retention_seconds >= 60 && var.queue_message_retention_seconds <= 1209600 && floor(var.queue_message_retention_seconds) == var.queue_message_retention_seconds
    error_message = "queue_message_retention_seconds must be a whole number of seconds from 60 to 1209600 (SQS limits)."
  }
}

# -- spot GPU node group ----------------------------------------------------------------------------

variable "node_group" {
  description = "An EKS managed node group of SPOT GPU instances, labelled eks.amazonaws.com/capacityType=SPOT by EKS and tainted nvidia.com/gpu=true:NoSchedule, which examples/spotjob-eks.yaml selects and tolerates. Null: none (bring your own, e.g. a Karpenter NodePool)."
  type = object({
    cluster_name   = string
    subnet_ids     = list(string)
    instance_types = optional(list(string), ["g5.xlarge", "g5.2xlarge", "g6.xlarge", "g6.2xlarge"])
    ami_type       = optional(string, "AL2023_x86_64_NVIDIA")
    min_size       = optional(number, 0)
    desired_size   = optional(number, 2)
    max_size       = optional(number, 4)
    disk_size      = optional(number, 100)
    labels         = optional(map(string), {})
    node_role_arn  = optional(string)
  })
  default = null

  validation {
    condition     = var.node_group == null || try(length(var.node_group.subnet_ids) > 0 && length(var.node_group.instance_types) > 0, false)
    error_message = "node_group needs at least one subnet and one instance type (several types: spot capacity is found per type)."
  }
  validation {
    condition     = var.node_group == null || try(var.node_group.min_size <= var.node_group.desired_size && var.node_group.desired_size <= var.node_group.max_size && var.node_group.max_size >= 1, false)
    error_message = "node_group sizes must satisfy min_size <= desired_size <= max_size and max_size >= 1."
  }
  # The rest are what the provider or EKS refused, at plan naming the node group's own attribute
  # (cluster_name, scaling_config.0.min_size) or only at apply (CreateNodegroup), never the input.
  validation {
    condition     = var.node_group == null || try(var.node_group.min_size >= 0 && alltrue([for n in [var.node_group.min_size, var.node_group.desired_size, var.node_group.max_size] : floor(n) == n]), false)
    error_message = "node_group.min_size, desired_size and max_size must be whole numbers of nodes, min_size at least 0."
  }
  validation {
    condition     = var.node_group == null || try(can(regex("^[0-9A-Za-z][A-Za-z0-9_-]{0,99}$", var.node_group.cluster_name)), false)
    error_message = "node_group.cluster_name must be an EKS cluster's name: 1 to 100 letters, digits, '-' and '_', beginning with a letter or digit."
  }
  validation {
    condition     = var.node_group == null || try(alltrue([for s in var.node_group.subnet_ids : can(regex("^subnet-[0-9a-f]{8,17}$", s))]), false)
    error_message = "node_group.subnet_ids must be subnet IDs (subnet-0123456789abcdef0), not names or ARNs."
  }
  validation {
    condition     = var.node_group == null || try(alltrue([for i in var.node_group.instance_types : can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9-]+$", i))]), false)
    error_message = "node_group.instance_types must be EC2 instance types, family.size in lower case (g5.xlarge, p4d.24xlarge)."
  }
  validation {
    condition     = var.node_group == null || try(floor(var.node_group.disk_size) == var.node_group.disk_size && var.node_group.disk_size >= 1 && var.node_group.disk_size <= 16384, false)
    error_message = "node_group.disk_size must be a whole number of GiB from 1 to 16384 (the largest EBS volume)."
  }
  # EKS takes a node group's labels as Kubernetes labels, each key and value 1 to 63 characters.
  validation {
    condition     = var.node_group == null || try(alltrue([for k, v in var.node_group.labels : length(k) <= 63 && can(regex("^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$", k)) && length(v) <= 63 && can(regex("^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$", v))]), false)
    error_message = "node_group.labels must be Kubernetes labels EKS takes: keys of at most 63 characters ([prefix/]name: letters, digits, '-', '_', '.'), values of 1 to 63 letters, digits, '-', '_' and '.', beginning and ending with a letter or digit."
  }
  validation {
    condition     = var.node_group == null || try(var.node_group.node_role_arn == null || can(regex("^arn:aws[a-z-]*:iam::[0-9]{12}:role/.+$", var.node_group.node_role_arn)), false)
    error_message = "node_group.node_role_arn must be an IAM role's ARN (arn:aws:iam::ACCOUNT:role/NAME), or null for the module's own role."
  }
}
