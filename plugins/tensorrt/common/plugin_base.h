// Shared IPluginV3 boilerplate (CRTP): capability dispatch, identity, clone, a creator template.
// A plugin class Derived provides kName, kVersion, a copy constructor, `static Derived create(
// PluginFieldCollection const*)` (throws std::invalid_argument), `static void describe_fields(FieldList&)`
// and `void list_fields(FieldList&) const` (its current values, for serialization).
#pragma once

#include "plugin_fields.h"
#include "plugin_log.h"

#include <NvInferRuntime.h>

#include <exception>

namespace dhisparse
{
namespace trt
{

constexpr char const* kPluginNamespace = "dhisparse";

template <typename Derived, typename Build = nvinfer1::IPluginV3OneBuild>
class PluginBase : public nvinfer1::IPluginV3,
                   public nvinfer1::IPluginV3OneCore,
                   public Build,
                   public nvinfer1::IPluginV3OneRuntime
{
public:
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override
    {
        switch (type)
        {
        case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
        case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<Build*>(this);
        case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
        }
        return nullptr;
    }

    nvinfer1::IPluginV3* clone() noexcept override
    {
        try
        {
            return new Derived(static_cast<Derived const&>(*this));
        }
        catch (std::exception const& e)
        {
            log_error(Derived::kName, e.what());
            return nullptr;
        }
    }

    char const* getPluginName() const noexcept override
    {
        return Derived::kName;
    }

    char const* getPluginVersion() const noexcept override
    {
        return Derived::kVersion;
    }

    char const* getPluginNamespace() const noexcept override
    {
        return kPluginNamespace;
    }

    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* /*in*/, int32_t /*nbInputs*/,
        nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t /*nbOutputs*/) noexcept override
    {
        return 0;
    }

    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* /*in*/, int32_t /*nbInputs*/,
        nvinfer1::PluginTensorDesc const* /*out*/, int32_t /*nbOutputs*/) noexcept override
    {
        return 0;
    }

    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept override
    {
        return clone();
    }

    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override
    {
        mSerialFields = FieldList{};
        static_cast<Derived const&>(*this).list_fields(mSerialFields);
        return mSerialFields.collection();
    }

protected:
    PluginBase() = default;
    PluginBase(PluginBase const&) {}  // mSerialFields points into the source object: rebuilt on demand
    PluginBase& operator=(PluginBase const&) = delete;

private:
    FieldList mSerialFields;
};

//! The IPluginCreatorV3One of plugin class P (build and runtime phases parse the same fields).
template <typename P>
class PluginCreator : public nvinfer1::IPluginCreatorV3One
{
public:
    PluginCreator()
    {
        P::describe_fields(mFieldNames);
    }

    nvinfer1::IPluginV3* createPlugin(char const* /*name*/, nvinfer1::PluginFieldCollection const* fc,
        nvinfer1::TensorRTPhase /*phase*/) noexcept override
    {
        try
        {
            return new P(P::create(fc));
        }
        catch (std::exception const& e)
        {
            log_error(P::kName, e.what());
            return nullptr;
        }
    }

    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override
    {
        return mFieldNames.collection();
    }

    char const* getPluginName() const noexcept override
    {
        return P::kName;
    }

    char const* getPluginVersion() const noexcept override
    {
        return P::kVersion;
    }

    char const* getPluginNamespace() const noexcept override
    {
        return kPluginNamespace;
    }

private:
    FieldList mFieldNames;
};

//! True when tensor `pos` of a format query is linear and of type `type`.
inline bool is_linear(nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t pos, nvinfer1::DataType type)
{
    return inOut[pos].desc.format == nvinfer1::TensorFormat::kLINEAR && inOut[pos].desc.type == type;
}

} // namespace trt
} // namespace dhisparse
