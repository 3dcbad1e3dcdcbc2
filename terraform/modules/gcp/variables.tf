variable "project_id" {
  description = "The Google Cloud project everything is created in (and whose Workload Identity pool, <project>.svc.id.goog, the GKE cluster uses)."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.project_id))
    error_message = "project_id must be a Google Cloud project ID: 6 to 30 lowercase letters, digits and '-'."
  }
}

variable "name" {
  description = "Prefix of every resource's name (bucket, service accounts, node pool)."
  type        = string
  default     = "spotjob"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{0,10}[a-z0-9]$", var.name))
    error_message = "name must be 2 to 12 lowercase letters, digits and '-', starting with a letter (service account IDs are at most 30 characters)."
  }
}

variable "labels" {
  description = "Labels added to every resource that takes labels (the bucket, the node pool's VMs): at most 64, keys of 1 to 63 lowercase letters, digits, '_' and '-' beginning with a letter, values of up to 63 of the same."
  type        = map(string)
  default     = {}

  # Google Cloud's rule for a resource's labels: the bucket, then the node pool, refused another at
  # apply, naming neither this variable nor the label.
  validation {
    condition     = length(var.labels) <= 64 && alltrue([for k, v in var.labels : can(regex("^[\\p{Ll}\\p{Lo}][\\p{Ll}\\p{Lo}\\p{N}_-]{0,62}$", k)) && can(regex("^[\\p{Ll}\\p{Lo}\\p{N}_-]{0,63}$", v))])
    error_message = "labels: at most 64 labels, each key 1 to 63 lowercase letters, digits, '_' and '-' beginning with a lowercase letter, each value up to 63 of the same (Google Cloud's rule for labels)."
  }
}

# -- checkpoint bucket ------------------------------------------------------------------------------

variable "location" {
  description = "The bucket's location: a region next to the GPUs (e.g. \"us-central1\"), or a multi-region."
  type        = string
}

variable "bucket_name" {
  description = "The checkpoint bucket's name. Null: \"<name>-checkpoints-<project id>\"."
  type        = string
  default     = null

  validation {
    condition     = var.bucket_name == null || can(regex("^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$", var.bucket_name))
    error_message = "bucket_name must be a valid GCS bucket name: 3 to 63 lowercase letters, digits, '.', '_' and '-'."
  }
  # Cloud Storage refused these at apply, after the plan had passed.
  validation {
    condition     = var.bucket_name == null || !can(regex("^goog|google|g00gle", var.bucket_name))
    error_message = "bucket_name must be a name Cloud Storage accepts: not beginning with goog, not containing google or g00gle."
  }
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete the bucket with the checkpoints in it; false refuses the whole destroy before anything is removed. A destroy reads it from the state: apply it first. Keep false outside tests."
  type        = bool
  default     = false
}

variable "kms_key_name" {
  description = "A Cloud KMS key for the bucket's default encryption (CMEK), as projects/<p>/locations/<l>/keyRings/<r>/cryptoKeys/<k>, in the bucket's location; the project's Cloud Storage service agent is granted roles/cloudkms.cryptoKeyEncrypterDecrypter on it. Null: Google-managed keys."
  type        = string
  default     = null

  validation {
    condition     = var.kms_key_name == null || can(regex("^projects/[^/]+/locations/[^/]+/keyRings/[^/]+/cryptoKeys/[^/]+$", var.kms_key_name))
    error_message = "kms_key_name must be a Cloud KMS key's name, projects/PROJECT/locations/LOCATION/keyRings/RING/cryptoKeys/KEY: not a key version (.../cryptoKeyVersions/N), a key ring or a key's URL."
  }
}

variable "noncurrent_version_expiration_days" {
  description = "Days a checkpoint object stays recoverable after spotjob's retention deleted or replaced it (object versioning keeps it noncurrent), before it is deleted. Live objects never expire: the newest valid checkpoint must never disappear."
  type        = number
  default     = 7

  validation {
    condition     = var.noncurrent_version_expiration_days >= 1 && floor(var.noncurrent_version_expiration_days) == var.noncurrent_version_expiration_days
    error_message = "noncurrent_version_expiration_days must be a whole number of days, at least 1."
  }
}

variable "soft_delete_retention_days" {
  description = "Days GCS soft delete keeps (and bills) an object after it was deleted, the lifecycle's deletes of noncurrent versions included. 0 (the default) turns soft delete off: versioning already keeps what spotjob deleted recoverable for noncurrent_version_expiration_days. Otherwise 7 to 90."
  type        = number
  default     = 0

  validation {
    condition     = var.soft_delete_retention_days == 0 || (var.soft_delete_retention_days >= 7 && var.soft_delete_retention_days <= 90 && floor(var.soft_delete_retention_days) == var.soft_delete_retention_days)
    error_message = "soft_delete_retention_days must be 0 (off) or a whole number of days from 7 to 90."
  }
}

variable "abort_incomplete_multipart_upload_days" {
  description = "Days after which an XML API multipart upload that never completed is aborted (other tools' uploads: spotjob uploads through JSON API resumable sessions, which GCS drops a week after they began)."
  type        = number
  default     = 1

  validation {
    condition     = var.abort_incomplete_multipart_upload_days >= 1 && floor(var.abort_incomplete_multipart_upload_days) == var.abort_incomplete_multipart_upload_days
    error_message = "abort_incomplete_multipart_upload_days must be a whole number of days, at least 1."
  }
}

# -- identities (Workload Identity) --------------------------------------------------------------------

variable "training_identities" {
  description = "One Google service account per entry for training pods, bound by Workload Identity to service_account in namespace only, with access to gs://<bucket>/<prefix>/ objects only. The map key names the service account (\"<name>-training-<key>\")."
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
    error_message = "Each training_identities prefix must be an object name prefix without leading or trailing '/', e.g. \"ml-training\"."
  }
  validation {
    condition = alltrue(flatten([
      for a in values(var.training_identities) : [
        for b in values(var.training_identities) : a.prefix == b.prefix || !startswith(b.prefix, "${a.prefix}/")
      ]
    ]))
    error_message = "No training_identities prefix may lie inside another's (\"a\" and \"a/b\")."
  }
  validation {
    condition     = alltrue([for k in keys(var.training_identities) : can(regex("^[a-z0-9]([a-z0-9-]{0,6}[a-z0-9])?$", k))])
    error_message = "training_identities keys name service accounts: up to 8 lowercase letters, digits and '-', beginning and ending with a letter or digit (service account IDs are at most 30 characters and end in one)."
  }
}

variable "controller_namespace" {
  description = "Namespace of the spotjob Helm release (the controller's Kubernetes ServiceAccount)."
  type        = string
  default     = "spotjob-system"

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", var.controller_namespace))
    error_message = "controller_namespace must be a Kubernetes namespace name."
  }
}

variable "controller_service_account" {
  description = "Name of the controller's Kubernetes ServiceAccount (the chart's serviceAccount.name; the helm_values output sets it)."
  type        = string
  default     = "spotjob"

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$", var.controller_service_account))
    error_message = "controller_service_account must be a Kubernetes service account name."
  }
}

# -- spot GPU node pool -----------------------------------------------------------------------------

variable "node_pool" {
  description = "A GKE node pool of Spot VMs with GPUs, tainted cloud.google.com/gke-spot=true:NoSchedule (GKE labels Spot VMs cloud.google.com/gke-spot=true and GPU nodes get nvidia.com/gpu=present:NoSchedule), which examples/spotjob-gke.yaml selects and tolerates. Null: none."
  type = object({
    cluster            = string
    location           = string
    node_locations     = optional(list(string))
    machine_type       = optional(string, "g2-standard-8")
    accelerator_type   = optional(string, "nvidia-l4")
    accelerator_count  = optional(number, 1)
    gpu_driver_version = optional(string, "LATEST")
    min_node_count     = optional(number, 0)
    max_node_count     = optional(number, 4)
    disk_size_gb       = optional(number, 100)
    service_account    = optional(string)
    labels             = optional(map(string), {})
  })
  default = null

  validation {
    condition     = var.node_pool == null || try(var.node_pool.min_node_count <= var.node_pool.max_node_count && var.node_pool.max_node_count >= 1 && var.node_pool.accelerator_count >= 1, false)
    error_message = "node_pool needs min_node_count <= max_node_count, max_node_count >= 1 and accelerator_count >= 1."
  }
  validation {
    condition     = var.node_pool == null || contains(["DEFAULT", "LATEST", "INSTALLATION_DISABLED"], try(var.node_pool.gpu_driver_version, ""))
    error_message = "node_pool.gpu_driver_version must be DEFAULT, LATEST or INSTALLATION_DISABLED."
  }
  # What the provider or GKE refused (a fractional count, a disk under 10 GB, a label Kubernetes
  # refuses) at plan naming the node pool's own attribute, or at apply, never this input.
  validation {
    condition     = var.node_pool == null || try(var.node_pool.min_node_count >= 0 && alltrue([for n in [var.node_pool.min_node_count, var.node_pool.max_node_count, var.node_pool.accelerator_count] : floor(n) == n]), false)
    error_message = "node_pool.min_node_count, max_node_count and accelerator_count must be whole numbers, min_node_count at least 0."
  }
  validation {
    condition     = var.node_pool == null || try(floor(var.node_pool.disk_size_gb) == var.node_pool.disk_size_gb && var.node_pool.disk_size_gb >= 10, false)
    error_message = "node_pool.disk_size_gb must be a whole number of GB, at least 10 (GKE's smallest boot disk)."
  }
  validation {
    condition     = var.node_pool == null || try(alltrue([for k, v in var.node_pool.labels : can(regex("^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$", k)) && length(split("/", k)[length(split("/", k)) - 1]) <= 63 && length(k) <= 317 && can(regex("^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$", v)) && length(v) <= 63]), false)
    error_message = "node_pool.labels must be Kubernetes labels: keys [prefix/]name (a DNS subdomain prefix, a name of at most 63 letters, digits, '-', '_' and '.', beginning and ending with a letter or digit), values of at most 63 of the same."
  }
}
